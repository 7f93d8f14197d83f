"""Ulysses attention with one exchange for the queries, keys and values together, for a sequence split's ranks.

diffusers' Ulysses attention (``attention_dispatch.TemplatedUlyssesAttention``) exchanges the queries, the keys and
the values with three all-to-alls before the attention and the output with a fourth after it. Each collective costs
the host a launch (NCCL) or a meeting (gloo, the threads' exchange) whatever its size, and per layer of a small
model that fixed cost is most of a rank's host time (issue 48, WP11: a tiny Flux rank cost 2.5-3x a plain call's
host time). xDiT and SGLang stack the three into one exchange; diffusers offers no such option, so pipemap puts a
subclass in its place (``install``) that does, for the configurations pipemap's own splits make
(``context.enable_split`` marks them: ``FUSED``) and where the three are alike (same shape and dtype, no mask to
gather); every other call, a user's own context parallelism included, runs diffusers' code unchanged. The stacked
exchange moves the same values to the same ranks, so the attention's inputs, and its output, are exactly
diffusers'. Backward is diffusers' own (per tensor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from diffusers.models import attention_dispatch
from torch._subclasses.fake_tensor import FakeTensor

FUSED = "_pipemap_fused"  # set on a ContextParallelConfig whose Ulysses exchanges take the stacked path
_ORIGINAL: Any = attention_dispatch.TemplatedUlyssesAttention


class FusedUlyssesAttention(_ORIGINAL):
    """diffusers' Ulysses attention with queries, keys and values exchanged by one all-to-all (where marked)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
                backward_op, _parallel_config=None):
        context: Any = _parallel_config.context_parallel_config if _parallel_config is not None else None
        alike = query.shape == key.shape == value.shape and query.dtype == key.dtype == value.dtype
        if not getattr(context, FUSED, False) or not alike or attn_mask is not None:
            return _ORIGINAL.forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                     return_lse, forward_op, backward_op, _parallel_config)
        group, ranks = context._ulysses_mesh.get_group(), context.ulysses_degree
        ctx.forward_op, ctx.backward_op, ctx._parallel_config = forward_op, backward_op, _parallel_config
        query, key, value = exchanged_inputs(query, key, value, group, ranks)
        out = forward_op(ctx, query, key, value, None, dropout_p, is_causal, scale, enable_gqa, return_lse,
                         _save_ctx=True, _parallel_config=_parallel_config)
        lse: Any = None
        if return_lse:
            out, lse, *_ = out
        out = heads_back(out, group, ranks)
        if return_lse:  # one value per head and token: the same exchange, with no last dimension
            lse = heads_back(lse.unsqueeze(-1), group, ranks).squeeze(-1)
        return (out, lse) if return_lse else out


def exchanged_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                     ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each rank's share of the tokens, all heads, to every token, its share of the heads: queries, keys and values
    stacked, sent in one all-to-all along the first dimension (one part per rank), taken apart again."""
    batch, tokens, heads, dim = query.shape
    stacked = torch.stack((query, key, value))  # (3, B, S, H, D)
    parts = stacked.reshape(3, batch, tokens, ranks, heads // ranks, dim).permute(3, 2, 0, 1, 4, 5).contiguous()
    arrived = exchange(parts, group)  # (ranks, S, 3, B, H/ranks, D): by sender
    joined = arrived.flatten(0, 1).permute(1, 2, 0, 3, 4).contiguous()  # (3, B, ranks x S, H/ranks, D)
    return joined[0], joined[1], joined[2]


def heads_back(out: torch.Tensor, group: Any, ranks: int) -> torch.Tensor:
    """The attention's output (every token, this rank's heads) back to this rank's tokens, every head."""
    batch, tokens, heads, dim = out.shape
    parts = out.reshape(batch, ranks, tokens // ranks, heads, dim).permute(1, 3, 0, 2, 4).contiguous()
    arrived = exchange(parts, group)  # (ranks, H/ranks, B, S/ranks, D): by sender
    return arrived.flatten(0, 1).permute(1, 2, 0, 3).contiguous()


def symbolic(t: torch.Tensor) -> bool:
    """Whether ``t`` is a stand-in (meta, a fake tensor) or being traced: where only the functional collectives
    (with their meta kernels and fake-tensor rules) will do."""
    return t.is_meta or isinstance(t, FakeTensor) or torch.compiler.is_compiling()


def exchange(parts: torch.Tensor, group: Any) -> torch.Tensor:
    """``parts`` (one slice per rank along the first dimension) sent to their ranks, the slices that arrive in its
    place. Real tensors take torch.distributed's all-to-all straight into a buffer; tracing and stand-in tensors
    diffusers' functional one (which meta kernels and FakeTensorMode understand). The functional op goes through
    Python-registered autograd, its async wrapper and a wait, about 60 us of host a collective (profiled on the
    tiny Flux's ranks, issue 48), for a result the same bytes."""
    if symbolic(parts):
        return attention_dispatch._all_to_all_single(parts, group)
    arrived = torch.empty_like(parts)
    dist.all_to_all_single(arrived, parts, group=group)
    return arrived


def install() -> None:
    """The stacked exchange where diffusers looks its Ulysses attention up (once; inert where not ``FUSED``)."""
    setattr(attention_dispatch, "TemplatedUlyssesAttention", FusedUlyssesAttention)  # noqa: B010 (a class slot)
