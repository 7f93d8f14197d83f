"""Quantized components (torchao and optimum-quanto int8 weights) on a placed pipeline: planned at the bytes they
store, moved as stored (never dequantized on the way), counted at their stored size by the dry run; under each
strategy on two GPUs remapped onto the CPU, against the same quantized pipeline on plain diffusers."""

from __future__ import annotations

import pytest
import torch

import pipemap
from everyday import ON_CPU, STRATEGIES, images, placed, plain, quantize, strays, two_gpu_plan
from pipemap.dryrun.queues import StandinQueues
from pipemap.dryrun.trackers import StorageTracker
from pipemap.hooks import Ledger, StreamHook, hook_component, unhook_component
from pipemap.hooks.stream import StreamSpec
from pipemap.inventory import module_bytes
from pipemap.quantized import storage, stored_bytes

LIBRARIES = ("quanto", "torchao")


def _stored(module: torch.nn.Module) -> int:
    """The bytes ``module`` really holds: each tensor's storage (int8 data and scales for a quantized weight)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(stored_bytes(t) for t in tensors.values())


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_quantized_denoiser_is_planned_at_its_stored_size(library):
    pipe = plain("sd")
    floating = module_bytes(pipe.unet)
    quantize(pipe.unet, library)
    stored = _stored(pipe.unet)
    planned = pipemap.inspect(pipe)["unet"].bytes
    assert abs(planned - stored) <= 0.05 * stored  # within 5% (exact here: the same tensors, persistent ones)
    assert planned < 0.85 * floating  # not its float size (quanto int8 all layers: 0.26x; torchao, linears: 0.8x)
    assert pipemap.plan(pipe, hardware="2x16MiB", strategy="balanced").placement("unet").bytes == planned


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_quantized_denoiser_runs_as_on_plain_diffusers(library, strategy):
    reference = plain("sd")
    quantize(reference.unet, library)
    pipe = plain("sd")
    quantize(pipe.unet, library)
    plan = two_gpu_plan(pipe, strategy)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    want = images(reference, "sd")
    torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-5, rtol=0)
    assert strays(pipe) == []
    moved = pipemap.stats(pipe)["unet"]["h2d_bytes"]
    if plan.placement("unet").mode == "offload":
        assert moved == _stored(pipe.unet)  # moved as stored: a dequantized copy would be 1.2x (torchao) to 3.8x
    kinds = {type(t).__name__ for t in pipe.unet.parameters()}
    pipemap.reset(pipe)
    assert {type(t).__name__ for t in pipe.unet.parameters()} == kinds  # still quantized after it all
    torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_streamed_quantized_block_takes_its_stored_size_on_the_gpu(library):
    # a quantized block of the tiny unet streamed through the dry run's stand-in queues, which count each buffer
    # they allocate as GPU weights: the block's buffer holds its storage (each tensor 16-byte aligned), not floats
    unet = quantize(plain("sd").unet, library)
    paths = ["down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1"]
    tracker = StorageTracker()
    ledger = Ledger(lambda device: StandinQueues(device, tracker))
    hook = StreamHook("unet", "cpu", "cpu", ledger, 0, StreamSpec(tuple(paths), depth=1))
    hook_component(unet, hook)
    try:
        sizes = [hook.blocks[i].layout.nbytes for i in hook.streamed]
        for index, path in enumerate(paths):
            block = unet.get_submodule(path)
            stored = sum(stored_bytes(t) for t in {id(t): t for t in block.parameters()}.values())
            leaves = [leaf for t in block.parameters() for leaf in storage(t)]
            assert stored <= sizes[index] <= stored + 16 * len(leaves)
            assert sizes[index] < 0.9 * module_bytes(plain("sd").unet.get_submodule(path)) or library == "torchao"
        hook._begin()  # one call's buffers: what the dry run counts on the GPU for this component
        assert ledger.peak["cpu"] == hook.charge
        hook._end()
    finally:
        unhook_component(unet)


@pytest.mark.slow
@pytest.mark.parametrize("library", LIBRARIES)
def test_the_dry_run_counts_quantized_weights_at_their_stored_size(library):
    pipe = plain("sd")
    quantize(pipe.unet, library)
    plan = two_gpu_plan(pipe, "balanced")  # everything resident: each GPU's weights are its components' bytes
    report = pipemap.simulate(pipe, plan)
    assert report.ok, report.error
    unet_gpu = plan.placement("unet").device
    resident = sum(p.bytes for p in plan.components if p.device == unet_gpu)
    assert report.weight_bytes[unet_gpu] <= resident + 4096  # non-persistent buffers aside (position ids)
    assert report.weight_bytes[unet_gpu] < resident - module_bytes(pipe.unet) + 0.9 * module_bytes(plain("sd").unet)


def test_placed_and_reset_leave_a_quantized_model_quantized():
    pipe, _ = placed("sd", "balanced_low_memory")
    quantize(pipe.text_encoder, "quanto")  # changed after dispatch: followed at the next call
    reference = plain("sd")
    quantize(reference.text_encoder, "quanto")
    torch.testing.assert_close(images(pipe, "sd"), images(reference, "sd"), atol=1e-5, rtol=0)
    assert strays(pipe) == []


class KeepsStateAside(torch.nn.Parameter):
    """A weight whose meaning lives partly outside its storage (bitsandbytes' Params4bit keeps its quant_state so)."""


def test_a_weight_that_cannot_be_packed_is_refused_before_anything_moves():
    pipe = plain("sd")
    plan = two_gpu_plan(pipe, "balanced_low_memory").remap(ON_CPU)
    layer = pipe.unet.conv_in
    layer.weight = KeepsStateAside(layer.weight.detach())
    with pytest.raises(pipemap.PlanMismatchError, match="conv_in.weight is a KeepsStateAside") as caught:
        pipemap.dispatch(pipe, plan)
    assert caught.value.component == "unet" and pipe.hf_device_map is None
    pipemap.dispatch(pipe, two_gpu_plan(pipe, "balanced").remap(ON_CPU))  # resident: nothing to pack
