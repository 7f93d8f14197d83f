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


def _both_ranks(groups, work):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(work, groups))


def test_real_tensors_take_torch_distributed_s_all_to_all_and_arrive_as_the_functional_one_s_do(monkeypatch):
    from diffusers.models import attention_dispatch

    from pipemap.hooks import exchange as groups_of
    from pipemap.hooks.ulysses import exchange

    groups = groups_of.thread_groups(2, "test-exchange")
    parts = [torch.arange(24.0).reshape(2, 3, 4) + 100 * rank for rank in range(2)]
    try:
        functional = _both_ranks(groups, lambda g: attention_dispatch._all_to_all_single(parts[g.rank()], g))
        taken: list[int] = []
        monkeypatch.setattr(attention_dispatch, "_all_to_all_single", lambda *a: taken.append(1))
        direct = _both_ranks(groups, lambda g: exchange(parts[g.rank()], g))
    finally:
        groups_of.release(groups)
    assert not taken  # straight to the group: no functional op, no autograd wrapping, no wait
    for rank in range(2):
        torch.testing.assert_close(direct[rank], functional[rank], atol=0, rtol=0)
        torch.testing.assert_close(direct[rank], torch.stack([parts[0][rank], parts[1][rank]]), atol=0, rtol=0)


def test_stand_in_tensors_take_the_functional_all_to_all_whose_fake_tensor_rule_shapes_them(monkeypatch):
    from diffusers.models import attention_dispatch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipemap.hooks import exchange as groups_of
    from pipemap.hooks.ulysses import exchange

    groups = groups_of.thread_groups(2, "test-exchange-fake")
    functional = attention_dispatch._all_to_all_single
    taken: list[int] = []
    monkeypatch.setattr(attention_dispatch, "_all_to_all_single", lambda *a: taken.append(1) or functional(*a))
    try:
        with FakeTensorMode():
            out = exchange(torch.empty(2, 3, 4), groups[0])  # one rank alone: a fake collective only shapes
    finally:
        groups_of.release(groups)
    assert taken == [1] and out.shape == (2, 3, 4)
