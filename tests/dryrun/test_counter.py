"""The dry run's work counter: FLOPs counted on stand-in devices equal torch's FLOP counter on the real CPU forward of
the same tiny model; bytes and kernels counted; work split into once-per-image and per-step."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pipemap import tiny
from pipemap.counts import PIPELINE
from pipemap.dryrun.counted import counting_plan
from pipemap.dryrun.run import count_work


def _one_call(pipe, component: str, call: dict) -> tuple[tuple, dict]:
    """The arguments of the first call of ``component`` in a real CPU run of ``pipe(**call)``."""
    seen = []
    module = getattr(pipe, component)
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    try:
        pipe(**call)
    finally:
        handle.remove()
    return seen[0]


def _flop_counter_flops(module, args: tuple, kwargs: dict) -> int:
    """torch's FlopCounterMode on the real CPU forward; attention by its math path (its products are counted as
    the matrix products they are)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module(*args, **kwargs)
    return counter.get_total_flops()


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "denoiser"), [("flux", "transformer"), ("sd", "unet")])
def test_dry_run_flops_of_a_denoiser_call_equal_torchs_counter_on_the_real_forward(kind, denoiser):
    pipe = tiny.build(kind)
    pipe.set_progress_bar_config(disable=True)
    call = tiny.default_call(pipe, kind, output_type="pt")
    args, kwargs = _one_call(pipe, denoiser, {**call, "num_inference_steps": 1})
    expected = _flop_counter_flops(getattr(pipe, denoiser), args, kwargs)

    counted = count_work(pipe, counting_plan(pipe, "float32"), **{k: v for k, v in call.items() if k != "generator"})
    work = counted[denoiser]
    assert work.once.flops == 0 and work.calls_per_step == 1  # one call a step (SD: both guidance halves in it)
    assert work.per_step.flops == expected > 0
    assert work.per_step.kernels > 0 and work.per_step.bytes > work.per_step.memory_bytes > 0
    assert counted.steps == call["num_inference_steps"]


@pytest.mark.slow
def test_work_outside_the_loop_is_counted_once_and_the_pipelines_own_code_apart():
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    call = {k: v for k, v in tiny.default_call(pipe, "sd", output_type="pt").items() if k != "generator"}
    counted = count_work(pipe, counting_plan(pipe, "float32"), steps=2, **call)
    four = count_work(pipe, counting_plan(pipe, "float32"), steps=4, **call)
    # the text encoder runs for the prompt and the negative prompt; the VAE decodes once
    assert counted["text_encoder"].calls_once == 2 and counted["vae"].calls_once == 1
    assert counted["text_encoder"].per_step.flops == 0 and counted["vae"].once.flops > 0
    # steps repeat: a 4-step dry run counts the same work per step and once
    for name in ("unet", "vae", "text_encoder"):
        assert four[name].per_step == counted[name].per_step and four[name].once == counted[name].once
    assert counted[PIPELINE].per_step.kernels > 0  # the scheduler's step and the guidance arithmetic
    unet = counted["unet"]
    assert sum(t.flops for _, t in unet.pieces) == pytest.approx(unet.per_step.flops / unet.calls_per_step)
    assert unet.inside("down_blocks").flops > 0 and unet.inside("").flops == pytest.approx(unet.per_call(2).flops)


# ---- attention, a work class of its own ---------------------------------------------------------------------------

BATCH, HEADS, TOKENS, WIDTH = 2, 4, 256, 8  # a score matrix (2 x 4 x 256 x 256 in bf16: 1 MiB) dwarfs the rest


class TinyTransformer(torch.nn.Module):
    """One self-attention layer as diffusers' transformers run it: projections, SDPA over heads, an output."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HEADS * WIDTH, 3 * HEADS * WIDTH)
        self.out = torch.nn.Linear(HEADS * WIDTH, HEADS * WIDTH)

    def forward(self, hidden, mask=None):
        q, k, v = (t.unflatten(-1, (HEADS, WIDTH)).transpose(1, 2) for t in self.qkv(hidden).chunk(3, dim=-1))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(attended.transpose(1, 2).flatten(2))


def _counted_forward(masked: bool):
    """One forward of ``TinyTransformer`` counted on stand-in tensors (bf16), as the dry run counts a call."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipemap.dryrun import standin
    from pipemap.dryrun.counter import WorkCounter

    module, mode = TinyTransformer(), FakeTensorMode(allow_non_fake_inputs=True)
    standin.fill_fakes(module, mode, "meta:0", torch.bfloat16, ()).eval()
    counter = WorkCounter(SimpleNamespace(components={"transformer": module}))
    with torch.no_grad(), standin.fused_attention(), mode, counter:
        hidden = torch.randn(BATCH, TOKENS, HEADS * WIDTH, device="meta:0", dtype=torch.bfloat16)
        mask = torch.ones(BATCH, 1, 1, TOKENS, device="meta:0", dtype=torch.bool) if masked else None
        module(hidden, mask)
    return counter.counts("Tiny", (), 1, 1, "bfloat16")["transformer"].total(1)


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "boolean key mask"])
def test_attention_flops_and_bytes_equal_an_independent_count(masked):
    work = _counted_forward(masked)
    # the fused kernel: 2 products of (tokens x width) by (width x tokens) per head, 2 FLOPs a multiply-add
    assert work.attention_flops == 4 * BATCH * HEADS * TOKENS * TOKENS * WIDTH
    # it reads queries, keys, values and the mask (boolean: made additive in bf16 first, as a GPU's SDPA does) and
    # writes the output (bf16), a random seed and offset (two int64) and no log-sum-exp (no backward)
    tensor = BATCH * HEADS * TOKENS * WIDTH * 2
    assert work.attention_bytes == 4 * tensor + (BATCH * TOKENS * 2 if masked else 0) + 16
    assert work.attention_scores == BATCH * HEADS * TOKENS * TOKENS
    # no score matrix materialised anywhere in the call (the math path's would be 1 MiB)
    assert work.bytes < BATCH * HEADS * TOKENS * TOKENS * 2 / 2
    # the projections are the rest of the FLOPs: 2 per weight per token
    linears = 2 * BATCH * TOKENS * (HEADS * WIDTH) * (4 * HEADS * WIDTH)
    assert work.flops == work.attention_flops + linears
