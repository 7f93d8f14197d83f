"""Ulysses attention with queries, keys and values in one exchange (``hooks/ulysses.py``): a sequence split's ranks
meet twice per attention layer, not four times, and their outputs are diffusers' own unstacked path's, exactly (the
same values reach the same ranks)."""

from __future__ import annotations

import torch

import pipemap
from pipemap import tiny
from pipemap.hooks.context import _processors
from pipemap.hooks.exchange import ThreadGroup
from pipemap.hooks.ulysses import FUSED, FusedUlyssesAttention

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


def diffusers_slot():
    from diffusers.models import attention_dispatch

    return attention_dispatch.TemplatedUlyssesAttention


def _stacked(hook, on: bool) -> None:
    for rank in (hook.home, *hook.replicas):
        for processor in _processors(rank):
            setattr(processor._parallel_config.context_parallel_config, FUSED, on)


def test_a_split_s_ranks_meet_twice_per_attention_and_compute_exactly_what_diffusers_own_path_does(monkeypatch):
    from helpers import with_copy

    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = {k: v for k, v in tiny.default_call(pipe, "flux", output_type="pt").items() if k != "generator"}
    call["num_inference_steps"] = 2
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU), ranks="thread")
    hook = pipe.transformer._hf_hook
    layers = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    meetings: list[int] = []
    exchange = ThreadGroup.all_to_all_single
    monkeypatch.setattr(ThreadGroup, "all_to_all_single", lambda self, *a: meetings.append(1) or exchange(self, *a))
    counted = []
    for stacked in (True, False):
        _stacked(hook, stacked)
        meetings.clear()
        counted.append(torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).images))
        ranks, calls = 2, 2  # every rank meets at each exchange; a call a step
        assert len(meetings) == ranks * calls * layers * (2 if stacked else 4)
    torch.testing.assert_close(counted[0], counted[1], atol=0, rtol=0)
    assert diffusers_slot() is FusedUlyssesAttention  # where diffusers looks its Ulysses attention up
    pipemap.reset(pipe)
