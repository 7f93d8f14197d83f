"""dryrun/trackers.py: live and peak bytes per stand-in device under ``FakeTensorMode`` (each storage once, freed
when it dies), weights told apart from activations, peaks after an assumed value marked as bounds, and which
component and which phase of the call (prompt encoding, each denoising step, VAE decode) is running."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pipemap
from pipemap.dryrun import standin
from pipemap.dryrun.trackers import ComponentTracker, Phase, PhasedTracker, PhaseTracker, StorageTracker
from pipemap.errors import ArgumentTypeError

FLOAT = 4  # bytes


@pytest.fixture
def mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def test_storage_tracker_counts_live_and_peak_bytes_per_stand_in_device(mode):
    tracker = StorageTracker()
    with mode, tracker:
        a = torch.empty(256, device="meta:0")
        b = torch.empty(1024, device="meta:1")
        view = a[:10]  # the same storage: not counted again
        assert tracker.live == {"meta:0": 256 * FLOAT, "meta:1": 1024 * FLOAT}
        del a, view
        assert tracker.live["meta:0"] == 0 and tracker.peak["meta:0"] == 256 * FLOAT  # freed; the high mark stays
        c = torch.empty(128, device="meta:0")
        assert tracker.peak["meta:0"] == 256 * FLOAT and tracker.live["meta:0"] == 128 * FLOAT
    # all of it activations: nothing was a weight
    assert tracker.activation_peak == {"meta:0": 256 * FLOAT, "meta:1": 1024 * FLOAT}
    assert sum(tracker.weight_peak.values()) == 0
    del b, c


def test_what_is_allocated_inside_allocating_weights_counts_as_weights(mode):
    tracker = StorageTracker()
    with mode, tracker:
        with tracker.allocating_weights():
            weights = torch.empty(100, device="meta:0")
        scratch = torch.empty(50, device="meta:0")
        assert tracker.weight_live["meta:0"] == 100 * FLOAT and tracker.live["meta:0"] == 150 * FLOAT
        assert tracker.activation_peak["meta:0"] == 50 * FLOAT
        onloaded = weights.to("meta:1")  # a weight's copy to another device is a weight there
        assert tracker.weight_live["meta:1"] == 100 * FLOAT and tracker.activation_peak["meta:1"] == 0
        doubled = weights * 2  # computed from a weight: an activation
        assert tracker.weight_live["meta:0"] == 100 * FLOAT and tracker.activation_peak["meta:0"] == 150 * FLOAT
        del weights, onloaded
    assert tracker.weight_live == {"meta:0": 0, "meta:1": 0} and tracker.weight_peak["meta:0"] == 100 * FLOAT
    del scratch, doubled


def test_module_tensors_are_the_weights_each_counted_once(mode):
    head = torch.nn.Linear(4, 10, bias=False)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), head)
    model[0].weight = head.weight  # tied
    fake = standin.fake_module(model, mode, "meta:0")
    tracker = StorageTracker()
    tracker.track_module_tensors(SimpleNamespace(components={"text_encoder": fake, "tokenizer": object()}))
    assert tracker.weights == {"meta:0": 40 * FLOAT} and tracker.weight_live == {"meta:0": 40 * FLOAT}
    assert tracker.live == tracker.peak == {"meta:0": 40 * FLOAT}


def test_a_peak_raised_after_an_assumed_value_is_marked_a_bound(mode):
    tracker = StorageTracker()
    with mode, tracker:
        first = torch.empty(10, device="meta:0")
        tracker.assume("every token routed to expert 0")
        tracker.assume("a later note")  # the first one stays
        second = torch.empty(10, device="meta:1")
    assert tracker.peak_bound == {"meta:1": "every token routed to expert 0"}
    del first, second


class _Vae(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder, self.post_quant_conv = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), \
            torch.nn.Identity()

    def forward(self, x):
        return self.decoder(self.post_quant_conv(x))


class _Scheduler:
    def step(self, x):
        return x


def _pipe():
    encoder = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    unet = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    return SimpleNamespace(components={"text_encoder": encoder, "unet": unet, "vae": _Vae(),
                                       "scheduler": _Scheduler(), "tokenizer": None})


def test_component_tracker_names_the_component_running_even_deep_inside_it():
    pipe = _pipe()
    seen = []
    pipe.components["unet"][1][0].register_forward_hook(lambda *_: seen.append(components.current))
    components = ComponentTracker(pipe)
    with components:
        pipe.components["unet"](torch.ones(2))
        assert components.current is None  # back in pipeline code
        pipe.components["text_encoder"](torch.ones(2))
    pipe.components["unet"](torch.ones(2))  # outside: no hooks left
    assert seen == ["unet", None]


def test_phase_tracker_follows_the_call_and_counts_scheduler_steps():
    pipe = _pipe()
    scheduler = pipe.components["scheduler"]
    phases = PhaseTracker(pipe)
    seen = []
    with phases.watching(scheduler):
        for name in ("text_encoder", "unet", "unet", "vae"):
            pipe.components[name](torch.ones(2))
            seen.append(str(phases.current))
            if name == "unet":
                scheduler.step(1)
    assert seen == ["prompt encoding", "denoising (step 1)", "denoising (step 2)", "VAE decode"]
    assert phases.steps_done == 2
    assert "step" not in scheduler.__dict__  # the scheduler's own method again
    pipe.components["unet"](torch.ones(2))
    assert str(phases.current) == "VAE decode"  # no hooks left


def test_phased_tracker_notes_the_phase_and_component_of_each_peak_and_a_timeline(mode):
    phases = SimpleNamespace(current=Phase("prompt encoding"))
    running = {"now": "text_encoder"}
    tracker = PhasedTracker(phases, lambda: running["now"])
    with mode, tracker:
        small = torch.empty(10, device="meta:0")
        phases.current, running["now"] = Phase("denoising", 1), "unet"
        large = torch.empty(100, device="meta:0")
        del large
        phases.current, running["now"] = Phase("VAE decode"), "vae"
        torch.empty(50, device="meta:0")  # under the peak: it keeps its phase
    assert tracker.peak_phase == {"meta:0": Phase("denoising", 1)} and tracker.peak_component == {"meta:0": "unet"}
    assert [(d, b) for d, b, _ in tracker.samples] == [("meta:0", 40), ("meta:0", 440), ("meta:0", 40),
                                                       ("meta:0", 240), ("meta:0", 40)]
    del small


def test_a_window_measures_the_rise_and_a_replay_counts_it_again_where_it_is_replayed(mode):
    phases = SimpleNamespace(current=Phase("VAE decode"))
    tracker = PhasedTracker(phases, lambda: "vae")
    with mode, tracker:
        with tracker.allocating_weights():
            weights = torch.empty(100, device="meta:0")
        base = torch.empty(10, device="meta:0")
        with tracker.window() as rises:
            scratch = torch.empty(50, device="meta:0")
            out = torch.empty(20, device="meta:0")
            del scratch
        # above the 110 floats live at its start: at most 70 more, all activations
        assert rises == {"meta:0": [70 * FLOAT, 70 * FLOAT, 0]} and tracker.peak["meta:0"] == 180 * FLOAT
        more = torch.empty(200, device="meta:0")  # 330 floats live now
        phases.current = Phase("VAE decode", None)
        tracker.replay(rises)  # as if the stretch ran again here: 330 + 70
        assert tracker.peak["meta:0"] == 400 * FLOAT and tracker.activation_peak["meta:0"] == 300 * FLOAT
        assert tracker.weight_peak["meta:0"] == 100 * FLOAT and tracker.live["meta:0"] == 330 * FLOAT
        assert tracker.samples[-1] == ("meta:0", 400 * FLOAT, Phase("VAE decode"))
        assert tracker.peak_component == {"meta:0": "vae"}
    del weights, base, out, more


@pytest.mark.slow
def test_phases_name_each_peak_and_tiling_advice_when_decode_does_not_fit(tiny_folders):
    folder = tiny_folders["sd"]
    # the VAE alone on a 4 MiB GPU: its 2.5 MiB of weights fit, a 96x96 decode does not, a tiled decode does
    plan = pipemap.plan(folder, hardware="2x4MiB,cpu=1GiB", headroom=0.0,
                        strategy={"unet": "cuda:0", "text_encoder": "cpu", "vae": "cuda:1"})
    report = pipemap.simulate(folder, plan, height=96, width=96)
    assert report.ok, report.error
    assert report.peak_phase["cuda:0"] in ("denoising (step 1)", "denoising (step 2)")
    assert report.peak_phase["cuda:1"] == "VAE decode" and report.peak_phase["cpu"] == "prompt encoding"
    assert report.peak_bytes["cuda:1"] > 4 * 2**20
    # the advice comes from a second dry run with vae.enable_tiling()
    assert len(report.advice) == 1 and report.advice[0].startswith("cuda:1: VAE decode peaks at")
    assert "pipe.vae.enable_tiling()" in report.advice[0] and report.advice[0].endswith(": fits")
    assert report.advice[0] in str(report)
    # advice=False: the same run and peaks, without the second dry run
    quick = pipemap.simulate(folder, plan, advice=False, height=96, width=96)
    assert quick.advice == () and quick.peak_bytes == report.peak_bytes
    with pytest.raises(ArgumentTypeError, match="advice"):
        pipemap.simulate(folder, plan, advice="no")
