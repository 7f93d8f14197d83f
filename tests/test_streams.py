"""The stream interface and its model: memory bounded whatever the host runs ahead, waits checked, pinned layout,
failures that leave nothing onloaded, one call per VAE decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pipemap
from helpers import plain_pipeline, run
from pipemap import granularity, streams
from pipemap.dryrun.trackers import StorageTracker
from pipemap.hooks import Ledger, packing
from pipemap.plan import Placement, Plan
from pipemap.units import aligned


def _moving(base: Plan, modes: dict[str, tuple[str, str]]) -> Plan:
    """``base`` with the components of ``modes`` moved: ``{name: (mode, execution GPU)}``; streamed ones cut as
    finely as the planner can (their charge: ``granularity.cut`` at the inventory's bytes in flight), offloaded
    ones with the component's bytes as room."""
    inv = {c.name: c for c in base_inventory[0].models}
    parts = []
    for p in base.components:
        if p.component in modes:
            mode, gpu = modes[p.component]
            if mode == "stream":  # its pieces as the planner lays them out at the fewest bytes it can stream in
                found = granularity.cut(inv[p.component].tree, inv[p.component].in_flight)
                p = Placement(p.component, "cpu", p.bytes, mode, gpu, found.in_flight, (), found.blocks,
                              found.resident, found.resident_bytes, found.prefetch, found.level)
            else:
                p = Placement(p.component, "cpu", p.bytes, mode, gpu, inv[p.component].bytes)
        parts.append(p)
    return dataclasses.replace(base, components=tuple(parts))


base_inventory: list = []


@pytest.fixture(scope="module")
def sd_plan(tiny_folders):
    """The tiny SD pipeline on two GPUs, the unet streamed to cuda:0, the text encoder and the vae to cuda:1."""
    folder = tiny_folders["sd"]
    base_inventory[:] = [pipemap.inspect(folder)]
    base = pipemap.plan(base_inventory[0], hardware="cuda:0=1GiB,cuda:1=1GiB,cpu=4GiB", strategy="balanced")
    return _moving(base, {"unet": ("stream", "cuda:0"), "text_encoder": ("stream", "cuda:1"),
                          "vae": ("stream", "cuda:1")})


@pytest.fixture
def model_queues(monkeypatch) -> list[streams.ModelQueues]:
    """Every stream model a dispatch makes, kept for the test to read."""
    made = []
    original = Ledger.queues

    def keep(self, device):
        queues = original(self, device)
        if all(q is not queues for q in made):
            made.append(queues)
        return queues

    monkeypatch.setattr(Ledger, "queues", keep)
    return made


# ---- memory bounded by construction ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, None])  # the GPU keeps up; the GPU does nothing until the host waits
def test_held_bytes_stay_within_the_charge_whatever_the_host_runs_ahead(tiny_folders, sd_plan, model_queues,
                                                                        monkeypatch, lag):
    monkeypatch.setattr(streams.ModelQueues, "lag", lag)
    report = pipemap.simulate(tiny_folders["sd"], sd_plan)
    assert report.ok, report.error
    charges = {gpu: max(p.room + p.resident_bytes for p in sd_plan.components if p.execution_device == gpu)
               for gpu in ("cuda:0", "cuda:1")}
    assert {str(q.device) for q in model_queues} == {"meta:0", "meta:1"}
    for queues in model_queues:
        gpu = f"cuda:{queues.device.index}"
        assert 0 < queues.peak <= charges[gpu], (gpu, queues.peak, charges)  # allocated plus pending frees
        assert queues.held == 0 and not queues.pending_frees
        # the dry run's own peak, storages counted as they live: no weights on the GPU beside those of the plan
        assert report.weight_peak_bytes[gpu] <= charges[gpu]


def test_a_block_used_before_its_copy_is_waited_for_fails_the_dry_run(tiny_folders, sd_plan, monkeypatch):
    monkeypatch.setattr(streams.ModelQueues, "wait", lambda self, event: None)
    report = pipemap.simulate(tiny_folders["sd"], sd_plan)
    assert not report.ok
    assert "before the compute queue waited for its copy" in report.error.message
    block = report.error.message.split("'")[1]  # the block named: a streamed component's block path
    component, _, path = block.partition(".")
    assert component in ("text_encoder", "unet", "vae") and path


def test_a_copy_into_a_buffer_still_in_use_is_refused():
    queues = streams.ModelQueues(torch.device("cpu"))
    buffer, source = queues.alloc(8), torch.arange(8, dtype=torch.uint8)
    last_use = queues.record(buffer)  # the compute queue read it until here
    queues.copy([(buffer, source)], after=last_use, name="unet.up_blocks.0")  # fine: waits for that use
    queues.record(buffer)
    with pytest.raises(streams.BufferReuseError, match="unet.up_blocks.1"):
        queues.copy([(buffer, source)], name="unet.up_blocks.1")


def test_memory_freed_while_a_copy_may_still_write_stays_held_in_the_dry_run_peak():
    mode, tracker = FakeTensorMode(allow_non_fake_inputs=True), StorageTracker()
    queues = streams.ModelQueues(torch.device("meta:0"))
    with mode, tracker:
        source = torch.empty(1000, dtype=torch.uint8)
        first = queues.alloc(1000)
        queues.copy([(first, source)], side=True)  # never waited for
        queues.free(first)
        del first
        second = queues.alloc(1000)  # the caching allocator cannot hand it the first buffer's memory
        assert queues.held == queues.peak == 2000 == tracker.live["meta:0"]
        queues.synchronize()  # the copy done: the first buffer's memory is free
        assert queues.held == 1000 == tracker.live["meta:0"]
        queues.free(second)
    assert queues.held == 0 and tracker.peak["meta:0"] == 2000


def test_stream_charge():
    assert granularity.stream_charge(10, [30, 20, 50, 40]) == 110  # root + 2 buffers of the largest block
    assert granularity.stream_charge(10, [30, 20, 50, 40], depth=2) == 10 + 140  # every block at once is less than 3x50
    assert granularity.stream_charge(7, []) == 7


# ---- pinned memory -----------------------------------------------------------------------------------------------


def test_pinned_buffer_is_exactly_the_group_layout(monkeypatch):
    registered = []
    monkeypatch.setattr(packing, "_pin_host", lambda buffer: registered.append(buffer.numel()))
    monkeypatch.setattr(packing, "_unpin_host", lambda buffer: registered.append(-buffer.numel()))
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2, bias=False))
    model.register_buffer("steps", torch.arange(3))
    values = {n: t.detach().clone() for n, t in model.state_dict().items()}
    group = packing.Group(packing.slots(model.modules()).values())
    sizes = [t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]]
    # 60 + 20 + 20 + 20 + 40 + 24 bytes; in the layout each start is aligned to 16: 64 + 32 + 32 + 32 + 48 + 24
    assert group.nbytes == sum(sizes) == 184
    assert group.layout.nbytes == sum(aligned(s) for s in sizes[:-1]) + sizes[-1] == 232
    group.pin()
    assert registered == [group.layout.nbytes] and packing.pinned_bytes() == 232
    host = group.host.data_ptr()
    assert all(host <= s.get().data_ptr() < host + 200 for s in group.slots)  # every master a view of it
    assert all(torch.equal(model.state_dict()[n], v) for n, v in values.items())
    model.half()  # a dtype change: the float masters are new tensors, pinned again at the next onload
    group.repin()
    assert registered == [232, -232, group.layout.nbytes] and group.layout.nbytes < 232 and group.pinned()
    current = group.host  # held here, so the allocator cannot hand its addresses to the new masters
    start, end = current.data_ptr(), current.data_ptr() + current.numel() * current.element_size()
    group.unpin()
    assert registered[-1] == -group.layout.nbytes and packing.pinned_bytes() == 0
    assert all(not (start <= s.get().data_ptr() < end) for s in group.slots)  # masters of their own again


# ---- failures leave nothing onloaded -----------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _fail_once(module: torch.nn.Module, after: int):
    """A pre-hook on ``module`` that raises at its ``after``-th call, once (an out-of-memory error, say)."""
    calls = []

    def hook(mod, args):
        calls.append(1)
        if len(calls) == after:
            raise Boom("simulated out of memory")

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("mode", ["stream", "offload"])
def test_a_failed_call_leaves_nothing_onloaded(tiny_folders, reference_outputs, sd_plan, mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = _moving(sd_plan, {"unet": (mode, "cuda:0")}).remap({"cuda:0": "cpu", "cuda:1": "cpu"})
    pipemap.dispatch(pipe, plan)
    hook = pipe.unet._hf_hook
    run(pipe, "sd")
    first = pipemap.stats(pipe, reset=True)["unet"]
    live = dict(hook.ledger.live)
    handle = _fail_once(pipe.unet.up_blocks[1], after=2)  # in the second step, half way through the unet
    with pytest.raises(Boom):
        run(pipe, "sd")
    handle.remove()
    onloaded = hook.group.loaded if mode == "offload" else any(g.loaded for g in [hook.root, *hook.blocks])
    assert not onloaded and hook.ledger.live["cpu"] <= live["cpu"] - (first["h2d_bytes"] if mode == "offload" else 0)
    pipemap.stats(pipe, reset=True)
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    again = pipemap.stats(pipe)["unet"]
    # the next call onloads what the first did (offload: once, as the first; stream: every block every call)
    assert again == first
    pipemap.reset(pipe)


# ---- one call per VAE decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stream", "offload", "resident"])
def test_stats_count_one_call_per_vae_decode(tiny_folders, sd_plan, mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    vae = sd_plan.placement("vae")
    plan = _moving(sd_plan, {"vae": (mode, "cuda:1")}) if mode != "resident" else dataclasses.replace(
        sd_plan, components=tuple(Placement("vae", "cuda:1", vae.bytes) if p is vae else p for p in sd_plan.components))
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    latents = torch.randn(1, pipe.vae.config.latent_channels, 8, 8)
    for _ in range(3):
        pipe.vae.decode(latents)
    assert pipemap.stats(pipe)["vae"]["calls"] == 3
    hook = pipe.vae._hf_hook
    if mode == "stream":  # every call ended: nothing left onloaded
        assert hook.depth == 0 and not any(g.loaded for g in [hook.root, *hook.blocks])
        assert hook.ledger.live["cpu"] == 0
    pipemap.reset(pipe)
