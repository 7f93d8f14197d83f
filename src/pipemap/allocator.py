"""CUDA's caching allocator as a plan counts it: the memory a GPU needs is what the allocator RESERVES, not only what
tensors allocate.

The rule, in words: each stream that allocates on a GPU has a pool of its own (stream-ordered reuse), and each pool
may hold a part-used segment of each size it cuts blocks from: requests up to 1 MiB come from 2 MiB segments,
requests up to 10 MiB from 20 MiB segments (c10/cuda/CUDACachingAllocator.cpp: kSmallBuffer, kLargeBuffer). The
free rest of such a segment serves only that pool's later requests that fit it, so a GPU whose tensors fill its
budget runs out with up to ``POOL_SLACK`` reserved but unallocated per pool. Measured under the fake CUDA
(tests/fakecuda.py, the same allocator rules): "balanced" on the smallest GPU it planned on ran out while loading
with 86.5 MiB allocated and 3.5 MiB cached when the next 20 MiB segment did not fit; issue 52 saw 16.3 MiB cached.

So a GPU's budget keeps ``POOL_SLACK`` for its default stream's pool, and ``POOL_SLACK`` more where a moving mode
(offload, stream) runs: its copies run on a side stream with a pool of its own (``runtime/streams.py``). A dry run's
peak is allocated bytes; ``reserved`` adds the same slack, which is what the device's memory must hold.

A GPU figure under ``SLACK_FROM`` cannot be a CUDA device (its context alone takes some 300 MiB): it is a budget
stated for a plan (a test's 5 MiB stand-in GPU), taken whole, as ``planner.CPU_HEADROOM_FROM`` does for the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

from .devices import is_accelerator
from .modes import Placed, facts

MIB = 2**20
SMALL_SEGMENT = 2 * MIB  # the small pool's segment, for requests up to 1 MiB (kSmallBuffer)
LARGE_SEGMENT = 20 * MIB  # the large pool's segment for requests under 10 MiB (kLargeBuffer)
POOL_SLACK = SMALL_SEGMENT + LARGE_SEGMENT  # a part-used segment of each size, per stream pool
SLACK_FROM = 64 * MIB  # a GPU under this is a stand-in budget: no allocator slack is kept on it


def pool_slack(memory: int) -> int:
    """The slack one stream pool may hold on a GPU of ``memory`` bytes (none on a stand-in under ``SLACK_FROM``)."""
    return POOL_SLACK if memory >= SLACK_FROM else 0


def side_pools(placements: Iterable[Placed], device: str) -> int:
    """The side stream pools the placements use on ``device``: one where a moving mode (offload, stream) runs there,
    whose copies run on a side stream."""
    return int(any(p.execution_device == device and facts(p.mode).moves_weights for p in placements))


def side_slack(placements: Iterable[Placed], device: str, memory: int) -> int:
    """The slack of the side pools the placements use on ``device`` (none on the CPU)."""
    return pool_slack(memory) * side_pools(placements, device) if is_accelerator(device) else 0


def slack(placements: Iterable[Placed], device: str, memory: int) -> int:
    """What the allocator may keep reserved on ``device`` beside what a plan's tensors allocate: ``POOL_SLACK`` for
    the default stream's pool and for each side pool (none on the CPU, or on a GPU under ``SLACK_FROM``)."""
    placements = list(placements)
    return (pool_slack(memory) if is_accelerator(device) else 0) + side_slack(placements, device, memory)
