"""The cost model on counted work: compute as the longer of the GPU's work and the host's launches, streamed calls
as their copy and compute queues run them, pieces' work by module, and the formula when nothing is counted."""

from __future__ import annotations

import pytest

import pipemap
from pipemap import Component, Inventory, Placement, Plan
from pipemap.cost import (
    Mechanism,
    Piece,
    Workload,
    call_seconds,
    compute_seconds,
    copy_seconds,
    formula_counts,
    gpu_seconds,
    predict,
    stream_call_seconds,
    waiting_call_seconds,
)
from pipemap.counts import ComponentCounts, Counts, Tally
from pipemap.granularity import Block
from pipemap.hardware import Hardware, Performance

PERF = Performance(flops=100e12, host_bandwidth=10e9, memory_bandwidth=1e12, kernel_seconds=1e-5)


def test_compute_is_the_gpus_work_or_the_hosts_launches_whichever_is_longer():
    heavy = Tally(flops=100e12, fp32_flops=0.0, memory_bytes=1e12, kernels=10)
    assert compute_seconds(heavy, PERF) == pytest.approx(1.0 + 1.0)
    launches = Tally(flops=1e9, kernels=10_000)
    assert compute_seconds(launches, PERF) == pytest.approx(0.1)
    upcast = Tally(flops=100e12, fp32_flops=100e12)  # float32 operands: half the rate
    assert compute_seconds(upcast, PERF) == pytest.approx(2.0)
    assert compute_seconds(heavy, PERF, on_gpu=False) == pytest.approx(100e12 / PERF.cpu_flops)


def test_a_streamed_call_overlaps_copies_with_compute_as_far_as_its_buffers_allow():
    even = [Piece(1.0, 1.0)] * 4
    assert stream_call_seconds(even) == pytest.approx(5.0)  # the first copy waits, the rest hide
    assert stream_call_seconds(even, overlap=False) == pytest.approx(8.0)
    slow_copies = [Piece(1.0, 2.0)] * 4
    assert stream_call_seconds(slow_copies) == pytest.approx(9.0)  # the link sets the pace
    # one piece ahead, two buffers: the third copy waits for the first piece's buffer (free at 4), then its copy
    mixed = [Piece(3.0, 1.0), Piece(0.1, 1.0), Piece(3.0, 1.0)]
    assert stream_call_seconds(mixed, depth=1) == pytest.approx(4.0 + 1.0 + 3.0)
    assert stream_call_seconds(mixed, depth=2) == pytest.approx(1.0 + 3.0 + 0.1 + 3.0)  # a third buffer
    assert stream_call_seconds(mixed, depth=1, own_buffers=True) == pytest.approx(7.1)
    assert stream_call_seconds(mixed, depth=1) <= stream_call_seconds(mixed, depth=1, overlap=False)
    assert stream_call_seconds([Piece(1.0), Piece(1.0, 1.0)], root_copy=0.5) == pytest.approx(2.5)


def test_a_launch_bound_host_asks_for_each_prefetch_as_it_reaches_the_piece_before():
    # every piece its own buffer, one ahead: the third copy is asked for when the host enters the second piece,
    # which a host launching 2 s of kernels a piece reaches at 2 s, not when the link is free (0.2 s)
    queued = [Piece(2.0, 0.1), Piece(2.0, 0.1), Piece(2.0, 3.0)]
    assert stream_call_seconds(queued, own_buffers=True) == pytest.approx(0.1 + 2.0 + 2.0 + 2.0)
    launched = [Piece(2.0, 0.1, 2.0), Piece(2.0, 0.1, 2.0), Piece(2.0, 3.0, 2.0)]
    assert stream_call_seconds(launched, own_buffers=True) == pytest.approx(2.0 + 3.0 + 2.0)
    assert stream_call_seconds(launched, depth=2, own_buffers=True) == pytest.approx(6.1)  # asked for at the start


def test_a_host_that_waits_at_each_piece_hides_a_copy_behind_one_piece_only():
    # diffusers' group offload with streams: the next copy starts as a piece begins, the host waits for the piece
    even = [Piece(1.0, 1.0)] * 4
    assert waiting_call_seconds(even) == pytest.approx(5.0)  # as queues ahead do, when every piece takes as long
    assert waiting_call_seconds(even, latency=0.1) == pytest.approx(5.4)  # the hook's time at each piece, on top
    # queues run ahead of a slow piece; a waiting host cannot: a slow piece hides one copy, a fast one none
    mixed = [Piece(3.0, 1.0), Piece(0.1, 1.0), Piece(0.1, 1.0), Piece(3.0, 1.0)]
    assert stream_call_seconds(mixed, depth=3, own_buffers=True) == pytest.approx(1.0 + 3.0 + 0.1 + 0.1 + 3.0)
    assert waiting_call_seconds(mixed) == pytest.approx(1.0 + 3.0 + 1.0 + 1.0 + 3.0)
    # pieces without a copy (the loose modules' work) hide the copy in flight too
    assert waiting_call_seconds([Piece(0.5), Piece(1.0, 1.0)]) == pytest.approx(2.0)
    assert call_seconds(mixed, 0.0, 3, True, Mechanism(waits=True)) == waiting_call_seconds(mixed)
    assert call_seconds(mixed, 0.0, 3, True, Mechanism()) == stream_call_seconds(mixed, depth=3, own_buffers=True)


def _tree() -> Block:
    blocks = tuple(Block(f"blocks.{i}", 100, 100) for i in range(4))
    return Block("", 400, 0, (Block("blocks", 400, 0, blocks, True),))


def test_a_streamed_component_is_priced_from_its_counted_pieces():
    unet = Component("unet", "diffusers", "UNet", 400, True, blocks=tuple((f"blocks.{i}", 100) for i in range(4)),
                     tree=_tree())
    # all the work in block 0: streaming the others hides their copies behind nothing but block 0's compute
    work = ComponentCounts("unet", per_step=Tally(flops=4e12), calls_per_step=1.0,
                           pieces=(("blocks.0.inner", Tally(flops=4e12)),))
    counts = Counts("X", (), 1, (work,), "bfloat16")
    inventory = Inventory("x", "X", (unet,), "bfloat16")
    placement = Placement("unet", "cpu", 400, "stream", "cuda:0", blocks=unet.blocks, prefetch=1)
    plan = Plan("x", (placement,), (), "cuda:0", "bfloat16")
    cost = predict(plan, inventory, PERF, Workload(steps=1), counts=counts)["unet"]
    assert cost.compute == pytest.approx(0.04)
    assert cost.transfer == pytest.approx(4 * copy_seconds(100, 10e9))
    assert cost.total == pytest.approx(cost.compute + cost.transfer - cost.hidden)
    # a piece below the counted modules takes its share of its nearest counted module by bytes
    deeper = Placement("unet", "cpu", 400, "stream", "cuda:0", blocks=(("blocks.0", 100), ("blocks.1", 100)),
                       prefetch=1)
    shallow = ComponentCounts("unet", per_step=Tally(flops=4e12), calls_per_step=1.0,
                              pieces=(("blocks", Tally(flops=4e12)),))
    priced = predict(Plan("x", (deeper,), (), "cuda:0", "bfloat16"), inventory, PERF, Workload(steps=1),
                     counts=Counts("X", (), 1, (shallow,), "bfloat16"))["unet"]
    assert priced.compute == pytest.approx(0.04)  # two pieces of a quarter each, the rest loose


def test_a_component_the_call_never_ran_costs_nothing_and_the_formula_prices_without_counts():
    inventory = pipemap.inspect("stable-diffusion-1.5")
    plan = pipemap.plan(inventory, hardware="1x24GiB,cpu=64GiB,gpu=a100")
    found = pipemap.catalog.recorded_counts("stable-diffusion-1.5")
    without = Counts(found.pipeline_class, (), 50, tuple(c for c in found.components if c.component != "vae"))
    assert predict(plan, inventory, PERF, counts=without)["vae"].total == 0
    formula = formula_counts(inventory, Workload(512, 512, 50, True))
    assert formula.origin == "formula" and formula["unet"].calls_per_step == 2
    assert formula["unet"].per_step.flops > 0 and formula["vae"].once.kernels > 0


def test_attention_is_priced_by_the_backend_the_stack_runs():
    # 10 TFLOP of which 4 in fused attention, 1e9 score elements, on an H100: dense (the fitted share), FlashAttention-2
    # (35% of the datasheet), FlashAttention-3 (75%), math (the dense rate plus 8 bytes a score through memory)
    work = Tally(flops=10e12, attention_flops=4e12, attention_scores=1e9)
    base = "1x80GiB,gpu=h100"
    dense, flash, fa3, math = (Hardware.parse(f"{base},attention={b}").performance
                               for b in ("dense", "flash", "fa3", "math"))
    assert gpu_seconds(work, dense) == pytest.approx(10e12 / dense.flops)
    assert gpu_seconds(work, flash) == pytest.approx(6e12 / dense.flops + 4e12 / (989e12 * 0.35))
    assert gpu_seconds(work, fa3) == pytest.approx(6e12 / dense.flops + 4e12 / (989e12 * 0.75))
    assert gpu_seconds(work, math) == pytest.approx(10e12 / dense.flops + 8e9 / dense.memory_bandwidth)
    assert "FlashAttention-2" in flash.origin and "dense rate" in dense.origin
    assert Hardware.parse(base).performance == flash  # a named GPU's default: what PyTorch's SDPA runs there
    with pytest.raises(pipemap.HardwareSpecError, match="gpu="):
        Hardware.parse("1x80GiB,attention=flash")
    with pytest.raises(pipemap.HardwareSpecError, match="backends"):
        Hardware.parse("1x80GiB,gpu=h100,attention=sage")
