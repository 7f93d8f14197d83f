"""Model offload (``hooks/offload.py``): components in CPU RAM copied whole to their GPU for their call and kept while
room allows, least recently used evicted first; run on the CPU (GPU plans remapped), by hand on small modules, and in
the dry run."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import moving, pipeline_state, plain_pipeline, run
from pipemap import tiny
from pipemap.dispatch import onload_peaks
from pipemap.hooks import Ledger, OffloadHook, hook_component, unhook_component
from pipemap.plan import Placement
from pipemap.planner import forcing_hardware


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


# ---- running on the CPU: GPU plans remapped ----------------------------------------------------------------------


@pytest.mark.slow  # over 2 s: out of the quick subset
@pytest.mark.parametrize("strategy", ["balanced_low_memory"])
@pytest.mark.parametrize("kind", tiny.KINDS)
def test_output_equals_plain_and_reset_restores(tiny_folders, reference_outputs, kind, strategy):
    pipe = plain_pipeline(tiny_folders[kind])
    gpu_plan = pipemap.plan(pipe, hardware=forcing_hardware(pipemap.inspect(pipe), strategy, 1), strategy=strategy,
                            headroom=0.0)
    assert {p.mode for p in gpu_plan.components} == {"resident", "offload"}
    assert all(d.used <= d.budget for d in gpu_plan.devices)
    run(pipe, kind)  # transformers installs hooks of its own at the first call
    before = pipeline_state(pipe)
    pipemap.dispatch(pipe, gpu_plan.remap({"cuda:0": "cpu"}))
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    moved = pipemap.stats(pipe)
    for p in gpu_plan.components:
        assert (moved[p.component]["h2d_bytes"] > 0) == (p.mode != "resident"), p.component
        assert moved[p.component]["d2h_bytes"] == 0 and moved[p.component]["calls"] > 0
    # in the accounting: residents plus what was onloaded at once stay within the GPU's budget (give or take the
    # non-persistent buffers, position_ids, which no header lists: 616 bytes a text encoder)
    resident = sum(p.bytes for p in gpu_plan.components if p.mode == "resident")
    assert resident + onload_peaks(pipe)["cpu"] <= gpu_plan.devices[0].budget + 4096
    pipemap.reset(pipe)
    assert pipeline_state(pipe) == before
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["offload"])
def test_a_failed_call_leaves_nothing_onloaded(tiny_folders, reference_outputs, sd_plan, sd_inventory, mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = moving(sd_plan, sd_inventory, {"unet": (mode, "cuda:0")}).remap({"cuda:0": "cpu", "cuda:1": "cpu"})
    pipemap.dispatch(pipe, plan)
    hook = pipe.unet._hf_hook
    run(pipe, "sd")
    first = pipemap.stats(pipe, reset=True)["unet"]
    live = dict(hook.ledger.live)
    handle = _fail_once(pipe.unet.up_blocks[1], after=2)  # in the second step, half way through the unet
    with pytest.raises(Boom):
        run(pipe, "sd")
    handle.remove()
    assert not hook.group.loaded and hook.ledger.live["cpu"] <= live["cpu"] - first["h2d_bytes"]
    pipemap.stats(pipe, reset=True)
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    again = pipemap.stats(pipe)["unet"]
    # the next call onloads what the first did: once, as the first
    assert again == first
    pipemap.reset(pipe)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "strategy"), [("controlnet", "balanced_low_memory")])
def test_dry_run_peaks_stay_within_each_stand_in_gpu(tiny_folders, kind, strategy):
    folder = tiny_folders[kind]
    gpu_plan = pipemap.plan(folder, hardware=forcing_hardware(pipemap.inspect(folder), strategy, 2), strategy=strategy,
                            headroom=0.0)
    assert any(p.mode == "offload" for p in gpu_plan.components)
    report = pipemap.simulate(folder, gpu_plan)
    assert report.ok, report.error
    for d in gpu_plan.devices[:-1]:
        assert d.used <= d.budget
        assert report.weight_peak_bytes[d.device] <= d.budget, (d.device, report.weight_peak_bytes)
    onloaded = {p.execution_device for p in gpu_plan.components if p.mode != "resident"}
    assert all(report.weight_peak_bytes[d] > report.weight_bytes[d] for d in onloaded)  # the onloads were measured


def test_simulate_refuses_a_pipeline_dispatched_with_offload(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    inv = pipemap.inspect(pipe)
    gpu_plan = pipemap.plan(inv, hardware=forcing_hardware(inv, "balanced_low_memory", 1),
                            strategy="balanced_low_memory", headroom=0.0)
    pipemap.dispatch(pipe, gpu_plan.remap({"cuda:0": "cpu"}))
    with pytest.raises(pipemap.PipelineMappedError):
        pipemap.simulate(pipe, gpu_plan)


# ---- by hand: two small modules sharing one GPU's room --------------------------------------------------------------


def _offloaded(name: str, room: int, ledger: Ledger) -> tuple[torch.nn.Module, OffloadHook]:
    """A ``Linear(8, 8)`` (288 bytes: a 256-byte weight and a 32-byte bias) offloaded to the CPU within ``room``."""
    torch.manual_seed(len(name))
    model = torch.nn.Linear(8, 8)
    hook = OffloadHook.for_placement(Placement(name, "cpu", 288, "offload", "cpu", room), "cpu", ledger)
    hook_component(model, hook)
    return model, hook


@pytest.mark.parametrize(("room", "onloads"), [(288, 4), (576, 2)])
def test_components_stay_onloaded_while_room_allows(room, onloads):
    ledger = Ledger()
    (a, hook_a), (b, hook_b) = _offloaded("a", room, ledger), _offloaded("b", room, ledger)
    masters = {id(p) for p in [*a.parameters(), *b.parameters()]}
    x = torch.ones(1, 8)
    expected = {id(m): torch.nn.functional.linear(x, m.weight, m.bias) for m in (a, b)}
    for model in (a, b, a, b):
        torch.testing.assert_close(model(x), expected[id(model)], atol=0, rtol=0)
        assert not any(id(p) in masters for p in model.parameters())  # it computed on its onloaded copy
    # room for one: each call evicts the other (a, b, a, b: four onloads); room for both: each onloaded once
    assert hook_a.moved.h2d_bytes + hook_b.moved.h2d_bytes == 288 * onloads
    assert hook_a.moved.calls == hook_b.moved.calls == 2 and hook_a.moved.d2h_bytes == 0  # eviction copies nothing
    assert ledger.live["cpu"] == ledger.peak["cpu"] == min(room, 576)
    assert hook_b.group.loaded and hook_a.group.loaded == (room == 576)
    for model in (a, b):
        unhook_component(model)
    assert {id(p) for p in [*a.parameters(), *b.parameters()]} == masters and ledger.live["cpu"] == 0
