"""Block streaming (``hooks/stream.py``): components in CPU RAM copied block by block through a few buffers, the
next blocks prefetched; run on the CPU (GPU plans remapped), by hand on small modules, and in the dry run."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import plain_pipeline, run
from pipemap.hooks import Ledger, hook_component, packing, stream, unhook_component
from pipemap.inventory import stream_blocks
from pipemap.plan import Placement
from pipemap.planner import forcing_hardware

# the call on the CPU equal to plain diffusers, and a failed call leaving nothing onloaded: tests/hooks/test_moving.py


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "strategy"), [("sd", "balanced_ultra_low_memory"),
                                                ("sdxl", "balanced_ultra_low_memory"),
                                                ("controlnet", "balanced_ultra_low_memory")])
def test_dry_run_peaks_stay_within_each_stand_in_gpu(tiny_folders, kind, strategy):
    folder = tiny_folders[kind]
    gpu_plan = pipemap.plan(folder, hardware=forcing_hardware(pipemap.inspect(folder), strategy, 2), strategy=strategy,
                            headroom=0.0)
    assert any(p.mode == "stream" for p in gpu_plan.components)
    # the peaks only: no tiling advice, a second dry run here (its own test: tests/dryrun/test_trackers.py)
    report = pipemap.simulate(folder, gpu_plan, advice=False)
    assert report.ok, report.error
    for d in gpu_plan.devices[:-1]:
        assert d.used <= d.budget
        assert report.weight_peak_bytes[d.device] <= d.budget, (d.device, report.weight_peak_bytes)
    onloaded = {p.execution_device for p in gpu_plan.components if p.mode != "resident"}
    assert all(report.weight_peak_bytes[d] > report.weight_bytes[d] for d in onloaded)  # the onloads were measured


def test_stream_swaps_weights_block_by_block(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    unet = pipe.unet
    masters = {name: id(t) for name, t in [*unet.named_parameters(), *unet.named_buffers()]}
    blocks = stream_blocks(unet)
    assert not any(isinstance(b, (torch.nn.ModuleList, torch.nn.ModuleDict)) for _, b in blocks)
    assert "down_blocks.0" in dict(blocks) and "mid_block.attentions.0" in dict(blocks)
    seen, ledger = [], Ledger()
    hook = stream.StreamHook.for_placement(Placement("unet", "cpu", 1, "stream", "cpu", 1), "cpu", ledger)
    hook_component(unet, hook)

    def check(name, block, args):  # runs after the stream hook's own pre-hook: the block is onloaded
        tensors = [*block.named_parameters(prefix=name), *block.named_buffers(prefix=name)]
        seen.append((name, all(id(t) != masters[n] for n, t in tensors), ledger.live["cpu"]))

    for name, block in blocks:
        block.register_forward_pre_hook(lambda b, a, name=name: check(name, b, a))
    run(pipe, "sd")
    unhook_component(unet)
    assert seen and all(onloaded for _, onloaded, _ in seen)
    largest = max(packing.Group(packing.slots(b.modules()).values()).layout.nbytes for _, b in blocks)
    assert max(live for *_, live in seen) == hook.charge == 2 * largest + hook.root.layout.nbytes  # two buffers
    assert {name: id(t) for name, t in [*unet.named_parameters(), *unet.named_buffers()]} == masters
    assert ledger.live["cpu"] == 0


def test_non_persistent_buffers_travel_with_their_block():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("shift", torch.arange(4.0), persistent=False)

        def forward(self, x):
            onloaded.append(self.shift is not masters[id(self)])  # the block's copy, not the CPU master
            return self.linear(x) + self.shift

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Block(), Block())
    masters, onloaded = {id(b): b.shift for b in model[1:]}, []
    expected = model(torch.ones(2, 4))
    assert [name for name, _ in stream_blocks(model)] == ["0", "1", "2"]
    onloaded.clear()
    placement = Placement("m", "cpu", 1, "stream", "cpu", 1)
    hook_component(model, stream.StreamHook.for_placement(placement, "cpu", Ledger()))
    torch.testing.assert_close(model(torch.ones(2, 4)), expected, atol=0, rtol=0)
    assert onloaded == [True, True]
    unhook_component(model)
    assert all(b.shift is masters[id(b)] for b in model[1:])


# ---- what a placement asks for ----------------------------------------------------------------------------------


def test_stream_spec_of_a_placement():
    assert stream.stream_spec(Placement("unet", "cpu", 100, "stream", "cuda:0", 50)) == stream.StreamSpec()
    pieces = Placement("unet", "cpu", 240, "stream", "cuda:0", 160, (), (("0", 80), ("1", 80), ("2", 80)), ("1",), 80,
                       2, 1)
    assert stream.stream_spec(pieces) == stream.StreamSpec(("0", "1", "2"), ("1",), 2, 240, 80)


def _three_linears() -> torch.nn.Sequential:
    """Three ``Linear(4, 4)``: 80 bytes each (a 64-byte weight, a 16-byte bias), no tensor of the root's own."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))


def test_a_spec_naming_no_module_of_the_live_model_is_laid_out_again():
    model = _three_linears()
    planned = stream.StreamSpec(("model.layers.0", "model.layers.1"), (), 1, room=10**6)  # a checkpoint's names
    live = planned.on(model, "text_encoder")
    assert live.blocks and all(model.get_submodule(p) is not None for p in live.blocks if p)
    kept = stream.StreamSpec(("0", "1", "2"), ("1",), 1, room=240)
    assert kept.on(model, "text_encoder") is kept  # every piece names a module: as planned


def test_resident_pieces_stay_and_only_the_rest_moves_at_each_call():
    model, x = _three_linears(), torch.ones(2, 4)
    expected = model(x)
    masters = [id(p) for p in model.parameters()]
    placement = Placement("m", "cpu", 240, "stream", "cpu", 160, (), (("0", 80), ("1", 80), ("2", 80)), ("1",), 80, 1)
    ledger = Ledger()
    hook = stream.StreamHook.for_placement(placement, "cpu", ledger)
    hook_component(model, hook)
    for call in (1, 2):
        torch.testing.assert_close(model(x), expected, atol=0, rtol=0)
        # the kept block onloaded at the first call only; blocks 0 and 2 at every call
        assert hook.moved.h2d_bytes == 80 + 2 * 80 * call
        assert [g.loaded for g in hook.blocks] == [False, True, False]
    assert hook.charge == 80 + 2 * 80  # the kept block, and a buffer for each of the two others (less than 2 x 80)
    assert ledger.live["cpu"] == 80 and ledger.peak["cpu"] == hook.charge
    unhook_component(model)
    assert [id(p) for p in model.parameters()] == masters and ledger.live["cpu"] == 0
