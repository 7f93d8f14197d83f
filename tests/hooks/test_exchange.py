"""The thread group's exchange (``hooks/exchange.py``) under the fake CUDA: its copies between GPUs go through the
copy check's verdict (a corrupting pair staged through host memory)."""

from __future__ import annotations

import threading
import warnings

import torch

import fakecuda
from pipemap.hooks.exchange import release, thread_groups
from pipemap.runtime import transfer


def _on_threads(ranks: int, work) -> list:
    results: list = [None] * ranks

    def run(rank):
        results[rank] = work(rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_the_exchange_stages_a_pair_the_copy_check_found_corrupting(fake_cuda):
    fake_cuda.corrupt_pairs = {(0, 1), (1, 0)}  # direct copies between the two GPUs arrive as zeros
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = transfer.ensure_safe_transfers(["cuda:0", "cuda:1"])
    assert report.corrupted and {("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")} <= transfer.staged_pairs()
    groups = thread_groups(2, "test")
    inputs = [(torch.arange(1.0, 9.0) * (rank + 1)).to(f"cuda:{rank}") for rank in range(2)]

    def work(rank):
        swapped, gathered = torch.empty(8, device=f"cuda:{rank}"), torch.empty(16, device=f"cuda:{rank}")
        groups[rank].all_to_all_single(swapped, inputs[rank], [4, 4], [4, 4])
        groups[rank].allgather_into_tensor_coalesced([gathered], [inputs[rank]])
        return fakecuda.host(swapped), fakecuda.host(gathered)

    try:
        results = _on_threads(2, work)
    finally:
        release(groups)
        transfer.clear_staged()
    plain = [fakecuda.host(t) for t in inputs]
    for rank, (swapped, gathered) in enumerate(results):
        torch.testing.assert_close(swapped, torch.cat([p[4 * rank:4 * rank + 4] for p in plain]), atol=0, rtol=0)
        torch.testing.assert_close(gathered, torch.cat(plain), atol=0, rtol=0)


def test_a_rank_ahead_does_not_queue_the_other_gpus_kernels_behind_its_own(fake_cuda):
    groups = thread_groups(2, "test")
    x = [torch.ones(8, 8, device=f"cuda:{rank}") for rank in range(2)]
    ahead, seen = threading.Event(), {}

    def work(rank):
        compute = torch.cuda.current_stream(rank)
        first = torch.empty(8, 8, device=f"cuda:{rank}")
        groups[rank].all_to_all_single(first, x[rank], [4, 4], [4, 4])
        if rank == 1:  # rank 1 runs ahead: its next kernel, then its next exchange's push
            _ = x[1] @ x[1]
            seen["kernel"] = compute.clock[compute.id]
            ahead.set()
        else:
            ahead.wait(30)
            threading.Event().wait(0.2)  # rank 1 has pushed and waits at the meeting
            _ = first @ x[0]  # rank 0's own next kernel
            seen["rank 0 saw of rank 1"] = compute.clock.get(torch.cuda.current_stream(1).id, 0)
        groups[rank].all_to_all_single(torch.empty(8, 8, device=f"cuda:{rank}"), x[rank], [4, 4], [4, 4])

    try:
        _on_threads(2, work)
    finally:
        release(groups)
    # pushed on the compute streams, rank 1's copy would fence cuda:0's stream behind rank 1's kernel (GPUs take turns)
    assert seen["rank 0 saw of rank 1"] < seen["kernel"]


def test_the_thread_group_answers_torchs_old_name_for_the_all_to_all():
    """torch 2.11 and older look a Python group's all-to-all up as ``alltoall_base`` only (the H200 found the
    thread path's sequence split failing there): the old name exchanges as the new one does."""
    groups = thread_groups(2, "test-old-name")
    inputs = [torch.arange(4.0) + 10 * rank for rank in range(2)]

    def work(rank):
        out = torch.empty(4)
        groups[rank].alltoall_base(out, inputs[rank], [2, 2], [2, 2])
        return out

    try:
        results = _on_threads(2, work)
    finally:
        release(groups)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out, torch.cat([p[2 * rank:2 * rank + 2] for p in inputs]), atol=0, rtol=0)
