"""dryrun/run.py, the dry run's entry: simulate() runs the pipeline's own call on stand-in GPUs (meta:N), from a
loaded pipeline or a folder (models built with fake weights, in eval mode); mistakes caught and named; peaks
measured."""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import tqdm.std
from torch._subclasses.fake_tensor import FakeTensorMode

import pipemap
from helpers import plain_pipeline
from pipemap import tiny
from pipemap.dispatch import planned
from pipemap.dryrun import standin
from pipemap.dryrun.run import _fake_pipeline, _progress, dry_call
from pipemap.dryrun.trackers import Phase, StorageTracker

# tiny models: unet 3.0 MiB, vae 2.5, controlnet 1.6, text encoders 0.2 each
GPUS = {2: "2x5MiB,cpu=1GiB", 3: "3x4MiB,cpu=1GiB"}
MAPS = {"sd": {"unet": "cuda:0", "vae": "cuda:1", "text_encoder": "cuda:1"},
        "sdxl": {"unet": "cuda:1", "vae": "cuda:0", "text_encoder": "cuda:0", "text_encoder_2": "cuda:1"},
        "controlnet": {"unet": "cuda:0", "vae": "cuda:1", "controlnet": "cuda:1", "text_encoder": "cuda:0"}}
MAPS_3 = {"controlnet": {"unet": "cuda:0", "vae": "cuda:1", "controlnet": "cuda:2", "text_encoder": "cuda:2"}}


@pytest.fixture(scope="module")
def pipes(tiny_folders):
    return {kind: plain_pipeline(folder) for kind, folder in tiny_folders.items()}


def _strategies(kind: str, gpus: int) -> list:
    return [*pipemap.STRATEGIES, (MAPS if gpus == 2 else MAPS_3)[kind], {"vae": f"cuda:{gpus - 1}"}]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "gpus"), [*((kind, 2) for kind in tiny.KINDS), ("controlnet", 3)])  # 3: the most
def test_every_strategy_runs_clean_on_stand_in_gpus(pipes, kind, gpus):  # models, a GPU each
    pipe = pipes[kind]
    reports: dict = {}  # by placement: strategies that place alike (on these GPUs most do) share one dry run
    for strategy in _strategies(kind, gpus):
        plan = pipemap.plan(pipe, hardware=GPUS[gpus], strategy=strategy, headroom=0.0)
        if plan.components not in reports:
            # the peaks only: no tiling advice, whose second dry run has its own test (tests/dryrun/test_trackers.py)
            reports[plan.components] = pipemap.simulate(pipe, plan, advice=False)
        report = reports[plan.components]
        assert report.ok, (strategy, report.error)
        used = {p.execution_device for p in plan.components}
        assert len(used) >= 2 and used <= set(report.peak_bytes)
        for device in used:
            assert report.peak_bytes[device] >= report.weight_bytes[device] > 0
            assert report.activation_bytes[device] == report.peak_bytes[device] - report.weight_bytes[device]


@pytest.mark.slow
def test_from_a_folder_without_reading_weights(tiny_folders):
    folder = Path(tiny_folders["controlnet"])
    weights = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    plan = pipemap.plan(folder, hardware=GPUS[3], headroom=0.0)
    before = _bytes_read()
    report = pipemap.simulate(folder, plan)
    read = _bytes_read() - before
    assert report.ok, report.error
    assert read < weights / 10, f"read {read} bytes of {weights} bytes of weights"


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.slow
def test_folder_and_pipeline_give_the_same_figures(tiny_folders, pipes):
    plan = pipemap.plan(tiny_folders["sdxl"], hardware=GPUS[2], headroom=0.0)
    # the figures only: no tiling advice (its second dry run has its own test, tests/dryrun/test_trackers.py)
    from_folder = pipemap.simulate(tiny_folders["sdxl"], plan, advice=False)
    from_pipe = pipemap.simulate(pipes["sdxl"], plan, advice=False)
    assert from_folder.peak_bytes == from_pipe.peak_bytes
    for device in plan.devices:  # the dry run also counts non-persistent buffers (position ids), not in the files
        assert device.used <= from_folder.weight_bytes[device.device] <= device.used * 1.01


@pytest.mark.slow
def test_caller_pipeline_is_untouched_and_runs_twice(pipes):
    pipe = pipes["sd"]
    before = {n: [(id(p), p.device, p.data_ptr()) for p in m.parameters()] for n, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    plan = pipemap.plan(pipe, hardware=GPUS[2], headroom=0.0)
    first, second = pipemap.simulate(pipe, plan), pipemap.simulate(pipe, plan)
    assert first.ok and first.peak_bytes == second.peak_bytes
    after = {n: [(id(p), p.device, p.data_ptr()) for p in m.parameters()] for n, m in pipe.components.items()
             if isinstance(m, torch.nn.Module)}
    assert after == before and pipe.hf_device_map is None
    assert not any(hasattr(m, "_hf_hook") for m in pipe.unet.modules())


@pytest.mark.slow
def test_a_dispatched_pipeline_can_be_simulated(tiny_folders):
    pipe = pipemap.load(tiny_folders["sd"], hardware="cpu=1GiB", progress=False)
    report = pipemap.simulate(pipe, pipemap.plan(tiny_folders["sd"], hardware=GPUS[2], headroom=0.0))
    assert report.ok, report.error
    assert planned(pipe).device_map == {"vae": "cpu", "text_encoder": "cpu", "unet": "cpu"}


def test_folder_built_models_are_in_eval_mode(flux_folder):
    folder = flux_folder
    plan = pipemap.plan(folder, hardware=GPUS[2], headroom=0.0)
    pipe = _fake_pipeline(folder, plan, FakeTensorMode(allow_non_fake_inputs=True), standin.devices_for(plan))
    models = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert len(models) == 4 and not any(m.training for m in [*models, *(s for m in models for s in m.modules())])


# ---- wrong dispatches are caught and named ----------------------------------------------------------------------


@pytest.fixture
def skip_hook(monkeypatch):
    """Make dispatch leave one component unhooked: the fault a dry run must catch."""

    def skip(component: str):
        module = importlib.import_module("pipemap.dispatch.following")  # where dispatch attaches each hook
        original = module.hook_component

        def hook_component(module, hook):
            if hook.component != component:
                original(module, hook)

        monkeypatch.setattr(module, "hook_component", hook_component)

    return skip


def test_missing_hook_on_the_controlnet_is_caught(pipes, skip_hook):
    plan = pipemap.plan(pipes["controlnet"], hardware=GPUS[2], strategy=MAPS["controlnet"], headroom=0.0)
    skip_hook("controlnet")
    report = pipemap.simulate(pipes["controlnet"], plan)
    assert not report.ok and report.error.component == "controlnet"
    assert set(report.error.devices) == {"cuda:0", "cuda:1"}


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_missing_hook_on_the_first_component_is_caught_in_pipeline_code(pipes, skip_hook):
    # diffusers takes the execution device from the first component's hook; without it, the pipeline's own code
    # makes latents on another GPU and mixes them
    plan = pipemap.plan(pipes["sd"], hardware=GPUS[2], strategy=MAPS["sd"], headroom=0.0)
    skip_hook("vae")
    report = pipemap.simulate(pipes["sd"], plan)
    assert not report.ok and set(report.error.devices) == {"cuda:0", "cuda:1"}
    assert "pipeline_stable_diffusion.py" in report.error.where


def test_text_encoder_whose_inputs_stay_on_another_device_is_caught(pipes, skip_hook):
    # token ids are made on the execution device (cuda:0); the encoder lives on cuda:1. Fake mode alone does not
    # check devices in embedding lookups: the strict check does.
    plan = pipemap.plan(pipes["sd"], hardware=GPUS[2], strategy=MAPS["sd"], headroom=0.0)
    skip_hook("text_encoder")
    report = pipemap.simulate(pipes["sd"], plan)
    assert not report.ok and report.error.component == "text_encoder"
    assert "embedding" in report.error.operation
    assert set(report.error.devices) == {"cuda:0", "cuda:1"}


def test_controlnet_passed_in_but_left_out_of_the_plan_is_caught(tiny_folders, pipes):
    plan = pipemap.plan(tiny_folders["sd"], hardware=GPUS[2], headroom=0.0)
    # as dispatch on real GPUs refuses it, before any dry run is built (issue 38: a plan for another pipeline)
    with pytest.raises(pipemap.PlanMismatchError, match="does not place it") as caught:
        pipemap.simulate(pipes["controlnet"], plan)
    assert caught.value.component == "controlnet"


# ---- peaks -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_larger_resolution_raises_the_activation_peak(pipes):
    plan = pipemap.plan(pipes["sdxl"], hardware=GPUS[2], headroom=0.0)
    small = pipemap.simulate(pipes["sdxl"], plan, height=32, width=32, advice=False)  # the peaks only, as above
    large = pipemap.simulate(pipes["sdxl"], plan, height=64, width=64, advice=False)
    denoiser = plan.device_map["unet"]
    assert large.activation_bytes[denoiser] > small.activation_bytes[denoiser]
    assert large.weight_bytes == small.weight_bytes


@pytest.mark.slow
@pytest.mark.parametrize("kind", tiny.KINDS)
def test_single_device_peak_matches_a_real_cpu_run(pipes, kind):
    pipe = pipes[kind]
    call = dry_call(pipe, 2, {"height": 64, "width": 64})
    tracker = StorageTracker()
    tracker.track_module_tensors(pipe)
    with tracker:
        pipe(**call)
    real = tracker.peak["cpu"]
    report = pipemap.simulate(pipe, pipemap.plan(pipe, hardware="1x1GiB"), height=64, width=64)
    assert report.ok
    assert abs(report.peak_bytes["cuda:0"] - real) <= 0.10 * real


@pytest.mark.slow
def test_measured_headroom_reserves_the_dry_run_peak(tiny_folders):
    plan = pipemap.plan(tiny_folders["controlnet"], hardware="2x8MiB,cpu=1GiB", headroom="measure")
    report = pipemap.simulate(tiny_folders["controlnet"], plan)
    assert report.ok
    for device in plan.devices:
        if device.device != "cpu":
            assert device.budget <= device.memory - report.activation_bytes.get(device.device, 0)
            assert device.used + report.activation_bytes.get(device.device, 0) <= device.memory
    assert any(note.startswith("headroom measured by a dry run") for note in plan.notes)


def test_measure_needs_a_pipeline_not_an_inventory(tiny_folders):
    with pytest.raises(pipemap.HeadroomError):
        pipemap.plan(pipemap.inspect(tiny_folders["sd"]), hardware=GPUS[2], headroom="measure")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_dry_run_over_a_few_seconds_shows_its_progress_on_a_terminal_and_a_quick_one_nothing(monkeypatch):
    # issue 38: the README's dry run printed nothing for minutes. tqdm's clock is moved by hand, not waited on
    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    for elapsed, shown in ((1.0, False), (3.5, True)):
        stderr = _Terminal()
        monkeypatch.setattr(sys, "stderr", stderr)
        phases = SimpleNamespace(steps_done=0, on_change=None)
        with _progress("dry run flux.1-dev", phases, 2):
            clock[0] += elapsed
            phases.steps_done = 1
            phases.on_change(Phase("denoising", 1))
        assert phases.on_change is None  # let go at the end
        text = stderr.getvalue()
        assert ("dry run flux.1-dev" in text and "1/2" in text and "denoising (step 1)" in text) == shown, text
    piped = io.StringIO()  # not a terminal (a log file, CI): never a bar
    monkeypatch.setattr(sys, "stderr", piped)
    phases = SimpleNamespace(steps_done=0, on_change=None)
    with _progress("dry run", phases, 2):
        clock[0] += 10
        phases.on_change(Phase("denoising", 1))
    assert piped.getvalue() == ""


@pytest.mark.slow  # a dry run of the tiny SDXL: 2 s
def test_a_dry_run_says_nothing_about_its_stand_ins(tiny_folders, capfd):
    # at float16 SDXL's call upcasts its VAE: diffusers' upcast_vae FutureWarning, "should be kept in float32: []"
    # logged for the fake VAE cast with to(), a fake tensor's __array__ DeprecationWarning: each said per dry run
    import warnings

    plan = pipemap.plan(tiny_folders["sdxl"], hardware="2x64MiB,cpu=1GiB", dtype="float16")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = pipemap.simulate(tiny_folders["sdxl"], plan, height=64, width=64, steps=1)
    assert report.fits and [str(w.message) for w in caught] == []
    assert "should be kept in float32" not in capfd.readouterr().err
