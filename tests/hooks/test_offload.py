"""Model offload (``hooks/offload.py``): components in CPU RAM copied whole to their GPU for their call and kept while
room allows, least recently used evicted first; run on the CPU (GPU plans remapped), by hand on small modules, and in
the dry run."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import plain_pipeline
from pipemap.hooks import Ledger, OffloadHook, hook_component, unhook_component
from pipemap.plan import Placement
from pipemap.planner import forcing_hardware

# the call on the CPU equal to plain diffusers, and a failed call leaving nothing onloaded: tests/hooks/test_moving.py


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
