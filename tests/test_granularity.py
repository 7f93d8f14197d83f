"""Streaming at any budget: pieces as fine as the room needs, partial residency, and the cost model's workload."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import plain_pipeline, run
from pipemap import tiny
from pipemap.cost import seconds_per_image, workload_for
from pipemap.granularity import LOOSE, Pieces, cut, stream_charge
from pipemap.hooks import packing
from pipemap.inventory import block_tree

GIB = 2**30


# sizes (bytes, each a multiple of the 16-byte alignment): a root tensor of 16; a list of two blocks of 320 and 160,
# the first holding a module of 256 (two leaves of 128) and one leaf of 64; a head leaf of 32
SIZES = {"scale": 16, "blocks.0.attn.q.weight": 128, "blocks.0.attn.k.weight": 128, "blocks.0.norm.weight": 64,
         "blocks.1.ff.weight": 160, "head.weight": 32}
TREE = block_tree(SIZES)


def test_coarse_pieces_where_the_room_allows():
    # two buffers of 320 beside 16 loose: 656 <= 700, so no piece is cut (nothing may stay resident here)
    assert cut(TREE, 700, 0) == Pieces((("blocks.0", 320), ("blocks.1", 160), ("head", 32)), 16, (), 1, 0)


def test_a_piece_larger_than_its_share_is_streamed_as_its_children():
    # 400: blocks.0 is cut (attn 256, norm 64); attn (256) still too large for two buffers beside it: cut to q, k
    found = cut(TREE, 400, 0)
    assert found.blocks == (("blocks.0.attn.k", 128), ("blocks.0.attn.q", 128), ("blocks.0.norm", 64),
                            ("blocks.1", 160), ("head", 32))
    assert found.level == 2 and found.in_flight == 16 + 2 * 160 <= 400
    assert cut(TREE, 2 * 160 + 16 - 1, 0) is None  # the 160 leaf cannot be cut


def test_pieces_stay_resident_beyond_the_buffers():
    found = cut(TREE, 600)
    assert found.resident_bytes + found.in_flight <= 600
    assert LOOSE in found.resident and found.resident_bytes > 16
    assert found.moved_per_call == sum(s for _, s in found.streamed)
    everything = cut(TREE, TREE.bytes)
    assert everything.moved_per_call == 0 and everything.in_flight == 0


@pytest.mark.slow
def test_workload_follows_each_pipelines_defaults_and_the_call():
    flux = workload_for(pipemap.inspect("flux.1-dev"))
    assert (flux.steps, flux.guidance, flux.calls) == (28, False, 28)
    sdxl = workload_for(pipemap.inspect("sdxl"))
    assert (sdxl.steps, sdxl.guidance, sdxl.calls, sdxl.height) == (50, True, 100, 1024)
    assert workload_for(pipemap.inspect("sdxl"), {"num_inference_steps": 30, "guidance_scale": 1.0}).calls == 30
    wan = workload_for(pipemap.inspect("wan2.1-t2v-14b"))
    assert wan.frames == 81 and wan.latent_tokens == 21 * 30 * 52


@pytest.mark.parametrize(("name", "machine"), [("flux.1-dev", "1x2GiB,cpu=64GiB"),
                                               ("stable-diffusion-xl-base-1.0", "1x4GiB,cpu=64GiB")])
def test_catalog_streams_within_a_small_gpu(name, machine):
    plan = pipemap.plan(name, hardware=machine, strategy="balanced_ultra_low_memory")
    denoiser = next(p for p in plan.components if p.component in ("transformer", "unet"))
    assert denoiser.mode == "stream" and denoiser.blocks and denoiser.resident_bytes + denoiser.room <= 4 * GIB
    assert all(d.used <= d.budget for d in plan.devices)
    assert "blocks, level" in str(plan)


def test_flux_partial_residency_seconds_fall_with_the_budget():
    inv = pipemap.inspect("flux.1-dev")
    perf = pipemap.Hardware.parse("1x1GiB,gpu=l20").performance
    resident = pipemap.plan(inv, hardware="1x48GiB,cpu=64GiB,gpu=l20", headroom=0.0)
    assert {p.mode for p in resident.components} == {"resident"}
    full = seconds_per_image(resident, inv, perf)
    seconds = [seconds_per_image(pipemap.plan(inv, hardware=f"1x{gib}GiB,cpu=64GiB,gpu=l20", headroom=0.0,
                                              strategy="balanced_ultra_low_memory"), inv, perf)
               for gib in (2, 4, 8, 12, 16, 20, 24)]
    # a coarser cut at a larger budget may wait a little longer for each call's first piece: within 0.5%
    assert all(a >= 0.995 * b for a, b in zip(seconds, seconds[1:])), seconds
    # 1.2: the text encoders, streamed once a prompt, are read through their files' maps (the page cache), not pinned;
    # at 2 GiB the transformer's copies show (1.16x: its attention priced at FlashAttention-2's rate on the L20, the
    # copies hide behind more compute than at the dense rate)
    assert seconds[4] <= 1.2 * full and seconds[0] > 1.1 * full, (seconds, full)


def _share(folder: str, component: str, share: float, extra: str | None) -> tuple[str, int]:
    """Two stand-in GPUs of ``share`` of the component's bytes (plus the fewest bytes ``extra`` needs streamed)."""
    inv = pipemap.inspect(folder)
    size = int(inv[component].bytes * share) + (inv[extra].in_flight if extra else 0)
    return f"cuda:0={size},cuda:1={size},cpu=1GiB", size


# the tiny Flux-like pipeline's CLIP token embedding (66 KB, one leaf) alone needs two buffers of 27% of its
# transformer: its GPUs get 15% of the transformer plus the fewest bytes the CLIP encoder streams in
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "component", "share", "extra"), [("sdxl", "unet", 0.25, None),
                                                                    ("flux", "transformer", 0.15, "text_encoder")])
def test_streams_at_a_fraction_of_the_denoiser(tiny_folders, flux_folder, kind, component, share, extra):
    folder = flux_folder if kind == "flux" else tiny_folders[kind]
    machine, budget = _share(folder, component, share, extra)
    plan = pipemap.plan(folder, hardware=machine, strategy="balanced_ultra_low_memory", headroom=0.0)
    streamed = plan.placement(component)
    assert streamed.mode == "stream" and streamed.granularity >= 1  # cut below its top-level modules
    assert streamed.resident_bytes + streamed.room <= budget  # all it ever holds on its GPU
    small = {"height": 32, "width": 32, "max_sequence_length": tiny.FLUX_TOKENS} if kind == "flux" else {}
    report = pipemap.simulate(folder, plan, **small)  # the size the real run below makes
    assert report.ok, report.error
    for d in plan.devices[:-1]:
        assert d.used <= d.budget and report.weight_peak_bytes[d.device] <= d.budget
    pipe = plain_pipeline(folder)
    expected = run(pipe, kind)
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    torch.testing.assert_close(run(pipe, kind), expected, atol=1e-5, rtol=0)
    pipemap.reset(pipe)


def test_partly_resident_denoiser_moves_only_its_streamed_pieces(tiny_folders):
    folder = tiny_folders["sdxl"]
    inv = pipemap.inspect(folder)
    plan = pipemap.plan(inv, hardware=f"cuda:0={inv['unet'].bytes * 3 // 4},cpu=1GiB",
                        strategy="balanced_ultra_low_memory", headroom=0.0)
    unet = plan.placement("unet")
    assert unet.mode == "stream" and 0 < unet.resident_bytes < unet.bytes
    pipe = plain_pipeline(folder)
    expected = run(pipe, "sdxl")
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu"}))
    run(pipe, "sdxl")
    pipemap.stats(pipe, reset=True)  # resident pieces moved once, at the first call
    torch.testing.assert_close(run(pipe, "sdxl"), expected, atol=1e-5, rtol=0)
    moved = pipemap.stats(pipe)["unet"]
    kept = set(unet.resident_blocks)
    hook = pipe.unet._hf_hook
    per_call = sum(g.nbytes for g, (path, _) in zip(hook.blocks, unet.blocks) if path not in kept)
    per_call += 0 if LOOSE in kept else hook.root.nbytes
    assert moved["h2d_bytes"] == moved["calls"] * per_call < moved["calls"] * packing.Group(
        packing.slots(pipe.unet.modules()).values()).nbytes
    pipemap.reset(pipe)


def test_stream_charge():
    assert stream_charge(10, [30, 20, 50, 40]) == 110  # root + 2 buffers of the largest block
    assert stream_charge(10, [30, 20, 50, 40], depth=2) == 10 + 140  # every block at once is less than 3x50
    assert stream_charge(7, []) == 7
