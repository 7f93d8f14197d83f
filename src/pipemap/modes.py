"""What a placement mode means, in one table: one row of facts per mode, and the one rule for a device's peak.

Code asks the table (``facts(placement.mode)``), not the mode's string: adding a mode is a row here and its hook's
module under ``pipemap.hooks``. ``Mode`` is a ``str`` enum, so saved plans and JSON keep the plain names
(``Placement(mode="offload")`` still works: the placement coerces the string).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from .devices import is_accelerator
from .errors import WorkersOptionError
from .units import format_bytes


class Mode(str, Enum):
    """A placement mode (``Placement.mode``); each one's facts are its row of ``TABLE``."""

    RESIDENT = "resident"
    OFFLOAD = "offload"
    STREAM = "stream"
    SPLIT = "split"
    REPLICATED = "replicated"
    GUIDANCE = "guidance"
    SEQUENCE = "sequence"
    GUIDANCE_SEQUENCE = "guidance_sequence"

    def __str__(self) -> str:  # the plain name in messages and f-strings, as the strings were
        return self.value


class Peak(str, Enum):
    """How a placement counts toward its execution device's peak, beside what it holds there (``held``)."""

    HELD = "held"  # only what it holds: nothing more while it runs
    ONLOADED = "onloaded"  # the whole of it while it runs: a device counts its largest such component once
    STREAMED = "streamed"  # its resident pieces always, and its blocks in flight (``room``) while it runs: the largest


class Placed(Protocol):
    """What the table's rules read of a ``plan.Placement`` (plan.py imports this module, not the reverse)."""

    @property
    def component(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def mode(self) -> str: ...

    @property
    def execution_device(self) -> str: ...

    @property
    def room(self) -> int: ...

    @property
    def shards(self) -> tuple[tuple[str, str, int], ...]: ...

    @property
    def blocks(self) -> tuple[tuple[str, int], ...]: ...

    @property
    def resident_blocks(self) -> tuple[str, ...]: ...

    @property
    def resident_bytes(self) -> int: ...

    @property
    def prefetch(self) -> int: ...

    @property
    def granularity(self) -> int: ...

    @property
    def replicas(self) -> tuple[str, ...]: ...

    @property
    def disk_blocks(self) -> tuple[str, ...]: ...

    @property
    def disk_bytes(self) -> int: ...

    @property
    def ram_bytes(self) -> int: ...


@dataclass(frozen=True)
class ModeFacts:
    """One mode's facts; every field is required, so a row cannot leave one out (``tests/test_modes.py``)."""

    mode: str
    moves_weights: bool  # its hook copies the weights from CPU RAM at its calls: one ledger, one call at a time
    copies: bool  # it keeps a whole copy on each of ``Placement.replicas``
    loads_on: str  # where ``from_pretrained`` loads it: "device" (its own) or "cpu" (dispatch moves it after)
    hook: tuple[str, str]  # (module, class) of its hook, imported when a plan first uses the mode
    ranks: bool  # its hook runs ranks on other devices (``hooks.ranks``: threads, worker processes or Ray actors)
    cost: str  # the pricing kind ``cost.py`` prices it by (its compute, the bytes it moves, which devices work)
    label: str  # what the picture calls what it puts on a device besides its home (a copy, the pieces it moves)
    pattern: str  # the picture's fill pattern for it: "" (plain), "hatch" or "dots"
    peak: Peak  # how it counts toward its execution device's peak (``device_use``)
    weightless_copy: bool  # a weightless copy of a pipeline placed so stands for it in a dry run (its hooks keep
    #                        no master of the weights that a copy could not share)
    text: Callable[[Placed], str]  # the plan table's description of a placement in this mode


def _disk(p: Placed) -> str:
    return f", from disk ({format_bytes(p.disk_bytes)})" if p.disk_bytes else ""


def _resident_text(p: Placed) -> str:
    return f"{p.mode}{_disk(p)}"


def _room_text(p: Placed) -> str:
    return f"{p.mode} (room {format_bytes(p.room)}){_disk(p)}"


def _stream_text(p: Placed) -> str:
    if not p.blocks:
        return _room_text(p)
    kept = len([b for b in p.resident_blocks if b])
    on_disk = f", {len(p.disk_blocks)} on disk ({format_bytes(p.disk_bytes)})" if p.disk_blocks else ""
    return (f"stream: {len(p.blocks)} blocks, level {p.granularity}, {kept} resident "
            f"({format_bytes(p.resident_bytes)}), prefetch {p.prefetch}, in flight {format_bytes(p.room)}{on_disk}")


def _split_text(p: Placed) -> str:
    away: dict[str, int] = {}
    for _, device, size in p.shards:
        away[device] = away.get(device, 0) + size
    return "split: " + ", ".join(f"{format_bytes(b)} on {d}" for d, b in away.items())


def _replicated_text(p: Placed) -> str:
    return "replicated: copies on " + ", ".join(p.replicas)


def _guidance_text(p: Placed) -> str:
    return f"guidance: 1st branch on {p.device}, 2nd on " + ", ".join(p.replicas) + _disk(p)


def _sequence_text(p: Placed) -> str:
    return "sequence: tokens split over " + ", ".join((p.device, *p.replicas)) + _disk(p)


def branch_devices(device: str, replicas: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A ``"guidance_sequence"`` placement's two branches: the GPUs that split each step's first call's tokens
    (``device`` first, where the output lands) and those that split its second (the first of them its output's)."""
    share = (1 + len(replicas)) // 2
    return (device, *replicas[:share - 1]), replicas[share - 1:]


def _guidance_sequence_text(p: Placed) -> str:
    first, second = branch_devices(p.device, p.replicas)
    return (f"guidance_sequence: 1st branch's tokens split over {', '.join(first)}, 2nd's over {', '.join(second)}"
            + _disk(p))


_HOOKS = "pipemap.hooks."
# Keyed by the mode's string, not by ``Mode``: an enum takes no member at run time, so a test registers a made-up
# mode as a row here (``register``) and a placement keeps its mode as a plain string; the built-in rows are ``Mode``s
TABLE: dict[str, ModeFacts] = {row.mode: row for row in (
    ModeFacts(mode=Mode.RESIDENT, moves_weights=False, copies=False, loads_on="device",
              hook=(_HOOKS + "resident", "PlacementHook"), ranks=False, cost="resident", label="resident",
              pattern="", peak=Peak.HELD, weightless_copy=True, text=_resident_text),
    ModeFacts(mode=Mode.OFFLOAD, moves_weights=True, copies=False, loads_on="cpu",
              hook=(_HOOKS + "offload", "OffloadHook"), ranks=False, cost="onload", label="onloaded",
              pattern="hatch", peak=Peak.ONLOADED, weightless_copy=False, text=_room_text),
    ModeFacts(mode=Mode.STREAM, moves_weights=True, copies=False, loads_on="cpu",
              hook=(_HOOKS + "stream", "StreamHook"), ranks=False, cost="stream", label="blocks in flight",
              pattern="dots", peak=Peak.STREAMED, weightless_copy=False, text=_stream_text),
    ModeFacts(mode=Mode.SPLIT, moves_weights=False, copies=False, loads_on="cpu",
              hook=(_HOOKS + "split", "SplitHook"), ranks=False, cost="split", label="shards",
              pattern="hatch", peak=Peak.HELD, weightless_copy=True, text=_split_text),
    ModeFacts(mode=Mode.REPLICATED, moves_weights=False, copies=True, loads_on="device",
              hook=(_HOOKS + "replica", "ReplicaHook"), ranks=True, cost="replicated", label="copy",
              pattern="hatch", peak=Peak.HELD, weightless_copy=True, text=_replicated_text),
    ModeFacts(mode=Mode.GUIDANCE, moves_weights=False, copies=True, loads_on="device",
              hook=(_HOOKS + "guidance", "GuidanceHook"), ranks=True, cost="guidance",
              label="copy: 2nd guidance branch", pattern="hatch", peak=Peak.HELD, weightless_copy=False,
              text=_guidance_text),
    ModeFacts(mode=Mode.SEQUENCE, moves_weights=False, copies=True, loads_on="device",
              hook=(_HOOKS + "sequence", "SequenceHook"), ranks=True, cost="sequence",
              label="copy: share of tokens", pattern="hatch", peak=Peak.HELD, weightless_copy=False,
              text=_sequence_text),
    ModeFacts(mode=Mode.GUIDANCE_SEQUENCE, moves_weights=False, copies=True, loads_on="device",
              hook=(_HOOKS + "guidance_sequence", "GuidanceSequenceHook"), ranks=True, cost="guidance_sequence",
              label="copy: a branch's share of tokens", pattern="hatch", peak=Peak.HELD, weightless_copy=False,
              text=_guidance_sequence_text),
)}


def facts(mode: str) -> ModeFacts:
    """The row of ``mode``; ``KeyError`` for a mode no row describes."""
    return TABLE[mode]


def register(row: ModeFacts) -> None:
    """Add a mode's row (a made-up mode in a test: ``tests/test_modes.py``); ``unregister`` takes it back."""
    TABLE[row.mode] = row


def unregister(mode: str) -> None:
    if mode in set(Mode):
        raise ValueError(f"{mode!r} is a built-in mode; only a registered one can be taken back")
    TABLE.pop(mode, None)


def known(mode: object) -> bool:
    return isinstance(mode, str) and mode in TABLE


def as_mode(mode: str) -> str:
    """``mode`` as its ``Mode`` member where it is a built-in one; a registered mode's string as it is."""
    try:
        return Mode(mode)
    except ValueError:
        return mode


# ---- what a placement holds, and a device's peak ------------------------------------------------------------------


def at_home(p: Placed, device: str) -> int:
    """What a placement keeps on its own ``device``: on the CPU its host copy in RAM (``Placement.ram_bytes``:
    less what stays in its files), on a GPU all but its shards."""
    if p.device != device:
        return 0
    return p.ram_bytes if device == "cpu" else p.bytes - sum(size for _, _, size in p.shards)


def held(p: Placed, device: str) -> int:
    """The bytes a placement holds on ``device`` for as long as it is placed: at home, its shards there, its copies
    there. The CPU counts the host copy in RAM only."""
    if device == "cpu":
        return at_home(p, device)
    copies = p.bytes * p.replicas.count(device) if facts(p.mode).copies else 0
    return at_home(p, device) + sum(size for _, d, size in p.shards if d == device) + copies


def device_use(placements: Iterable[Placed], device: str) -> int:
    """A device's peak: what every placement holds there, each streamed component's resident pieces, the largest
    component onloaded there, and the largest blocks in flight there (the moving hooks take turns, so one of each
    at once). The CPU's figure is its host copies in RAM (a plan adds its staging buffers)."""
    placements = list(placements)
    running = [p for p in placements if p.execution_device == device]
    by_peak: dict[Peak, list[Placed]] = {peak: [] for peak in Peak}
    for p in running:
        by_peak[facts(p.mode).peak].append(p)
    streamed = by_peak[Peak.STREAMED]
    return (sum(held(p, device) for p in placements) + sum(p.resident_bytes for p in streamed)
            + max((p.bytes for p in by_peak[Peak.ONLOADED]), default=0)
            + max((p.room for p in streamed), default=0))


# ---- what CUDA's caching allocator keeps reserved beside a device's peak -------------------------------------------
# The memory a GPU needs is what the allocator RESERVES, not only what tensors allocate.
#
# The rule, in words: each stream that allocates on a GPU has a pool of its own (stream-ordered reuse), and each pool
# may hold a part-used segment of each size it cuts blocks from: requests up to 1 MiB come from 2 MiB segments,
# requests up to 10 MiB from 20 MiB segments (c10/cuda/CUDACachingAllocator.cpp: kSmallBuffer, kLargeBuffer). The
# free rest of such a segment serves only that pool's later requests that fit it, so a GPU whose tensors fill its
# budget runs out with up to ``POOL_SLACK`` reserved but unallocated per pool. Measured under the fake CUDA
# (tests/fakecuda.py, the same allocator rules): "balanced" on the smallest GPU it planned on ran out while loading
# with 86.5 MiB allocated and 3.5 MiB cached when the next 20 MiB segment did not fit; issue 52 saw 16.3 MiB cached.
#
# So a GPU's budget keeps ``POOL_SLACK`` for its default stream's pool, and ``POOL_SLACK`` more where a moving mode
# (offload, stream) runs: its copies run on a side stream with a pool of its own (``runtime/streams.py``). A dry run's
# peak is allocated bytes; ``reserved`` adds the same slack, which is what the device's memory must hold.
#
# A GPU figure of ``SLACK_FROM`` or less cannot be a CUDA device (its context alone takes some 300 MiB): it is a budget
# stated for a plan (a test's 5 MiB stand-in GPU), taken whole, as ``planner.CPU_HEADROOM_FROM`` does for the CPU.

_MIB = 2**20
SMALL_SEGMENT = 2 * _MIB  # the small pool's segment, for requests up to 1 MiB (kSmallBuffer)
LARGE_SEGMENT = 20 * _MIB  # the large pool's segment for requests under 10 MiB (kLargeBuffer)
POOL_SLACK = SMALL_SEGMENT + LARGE_SEGMENT  # a part-used segment of each size, per stream pool
SLACK_FROM = 64 * _MIB  # a GPU of this or less is a stand-in budget: no allocator slack is kept on it


def pool_slack(memory: int) -> int:
    """The slack one stream pool may hold on a GPU of ``memory`` bytes (none on a stand-in of ``SLACK_FROM`` or less:
    the tests' 64 MiB GPUs)."""
    return POOL_SLACK if memory > SLACK_FROM else 0


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


# ---- how a split's ranks run -------------------------------------------------------------------------------------

RANKS = ("process", "thread", "ray")
"""What runs the other ranks of a split denoiser (the modes whose row says ``ranks``): a worker process per GPU that
pipemap spawns (``"process"``, the default), threads of the caller's process (``"thread"``: one GIL; what the dry
run's stand-ins always use), or the same worker processes as Ray actors (``"ray"``). ``"auto"`` asks for the
environment's choice (``PIPEMAP_WORKERS``), else processes."""
RANKS_ENV = "PIPEMAP_WORKERS"
AUTO_RANKS = "auto"


def resolve_ranks(value: object, environ: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """The runtime ``ranks=`` asks for, and whether it was asked for by name (then a model that cannot travel to a
    worker is an error, not a fall-back to threads): ``"auto"`` or None is ``PIPEMAP_WORKERS`` where set (``environ``:
    ``os.environ`` by default), else processes, not by name. ``WorkersOptionError`` for a word that names none, in the
    argument or in ``PIPEMAP_WORKERS``."""
    environ = os.environ if environ is None else environ
    word = value.strip().lower() if isinstance(value, str) else value
    if word is None or word == AUTO_RANKS:
        told = environ.get(RANKS_ENV, "").strip().lower()
        if not told:
            return "process", False
        if told in RANKS:
            return told, True
        raise WorkersOptionError(RANKS_ENV, environ.get(RANKS_ENV), RANKS)
    if word in RANKS:
        return str(word), True
    raise WorkersOptionError("ranks", value, (AUTO_RANKS, *RANKS))


def splits(p: Placed) -> bool:
    """Whether a placement's mode runs ranks on other devices (``ModeFacts.ranks``) and it has some."""
    return bool(p.replicas) and facts(p.mode).ranks
