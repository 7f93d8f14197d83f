"""``plan()``: decide where each component goes. Pure: it reads headers or module sizes and moves nothing.

Each strategy is one small function from a ``Problem`` (the components' sizes, each GPU's room) to
``{component: device}`` or, for the offloading strategies, ``{component: Place(device, mode, execution_device)}``;
the code around it validates input, applies dict maps and totals the budgets.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from . import replication
from .cost import (
    Workload,
    bytes_moved,
    images_per_second,
    launch_note,
    predict,
    seconds_per_image,
    workload_for,
)
from .counts import Counts
from .devices import is_accelerator, real_device
from .errors import (
    DoesNotFitError,
    HeadroomError,
    UnknownComponentError,
    UnknownDeviceError,
)
from .experts import EXPERTS
from .granularity import Block, Pieces, cut
from .hardware import Hardware
from .inventory.values import DENOISERS, Component, Inventory
from .modes import Mode, Peak, device_use, facts, held, pool_slack, side_slack
from .plan import Candidate, DeviceUse, Placement, Plan, with_ranks
from .tiers import place_tiers
from .units import format_bytes, parse_bytes

AUTO = "auto"
DEFAULT_HEADROOM = 0.10  # of each GPU's memory, kept for activations until a dry run measures them
# of the CPU's memory, at most CPU_HEADROOM_CAP: what the system and the process itself need beside the plan's host
# copies (an idle desktop's OS takes 1.5-3 GiB; this process with torch and diffusers imported ~0.5 GiB, its call's
# tensors more). Capped, so a large host is not kept idle. A CPU under CPU_HEADROOM_FROM cannot hold the process
# itself: it is a budget stated for the plan (a test's cpu=1GiB, a stand-in), taken whole. headroom={"cpu": ...}
# sets it
DEFAULT_CPU_HEADROOM = 0.10
CPU_HEADROOM_CAP = 4 * 2**30
CPU_HEADROOM_FROM = 2 * 2**30


_FRACTION = re.compile(r"^\s*(\d+\.\d*|\.\d+)\s*$", re.ASCII)  # "0.1" reads as the float it looks like
MAX_SEARCHED = 12  # components: beyond this, the offloading strategies try cheapest-first prefixes, not every set


@dataclass(frozen=True)
class Problem:
    """The placement problem a strategy solves (what a user asks is ``api.Request``): components ``(name, bytes)`` in
    pipeline order and the room left on each GPU; for the offloading strategies also each component's calls per
    image and bytes in flight when streamed (0: all)."""

    components: tuple[tuple[str, int], ...]
    rooms: tuple[tuple[str, int], ...]
    strategy: str
    calls: tuple[tuple[str, int], ...] = ()
    in_flight: tuple[tuple[str, int], ...] = ()
    blocks: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    trees: tuple[tuple[str, Block | None], ...] = ()  # module trees: a streamed component's pieces and residency
    # (denoiser, mode) strategy "parallel" may copy it for, the fastest first (``replication.parallel_modes``)
    parallel: tuple[tuple[str, str], ...] = ()
    heads: int = 0  # the denoiser's attention heads (0: unknown): a sequence split runs on GPU counts dividing them
    # each GPU's allocator slack for a side stream's pool, kept where a moved component runs (``modes.slack``)
    side_slack: tuple[tuple[str, int], ...] = ()


class Place(NamedTuple):
    """Where a strategy puts one component: weights on ``device``, computed on ``execution_device``; a split
    component's blocks placed elsewhere in ``shards`` ((path, device, bytes), ...)."""

    device: str
    mode: str
    execution_device: str
    shards: tuple[tuple[str, str, int], ...] = ()
    replicas: tuple[str, ...] = ()


Strategy = Callable[[Problem], dict[str, "str | Place"]]


def _balanced(request: Problem) -> dict[str, str | Place]:
    """Largest first, each to the GPU with the most room left: the fullest GPU ends as empty as it can be."""
    rooms = dict(request.rooms)
    placed: dict[str, str | Place] = {}
    for name, size in sorted(request.components, key=lambda c: (-c[1], c[0])):
        device = _roomiest(rooms)
        if size > rooms[device]:
            raise DoesNotFitError(name, size, rooms[device], request.strategy, ())
        rooms[device] -= size
        placed[name] = device
    return placed


def _roomiest(rooms: Mapping[str, int]) -> str:
    """The GPU with the most room left; of equal ones, the first."""
    order = list(rooms)
    return max(order, key=lambda d: (rooms[d], -order.index(d)))


def _sequential(request: Problem) -> dict[str, str | Place]:
    """Pipeline order: fill the first GPU, then the next; never go back to an earlier one."""
    devices = [d for d, _ in request.rooms]
    rooms = dict(request.rooms)
    placed: dict[str, str | Place] = {}
    current = 0
    for name, size in request.components:
        start = current
        while current < len(devices) and size > rooms[devices[current]]:
            current += 1
        if current == len(devices):
            # the largest room among the GPUs this strategy may still use, not the ones it has already left
            raise DoesNotFitError(name, size, max((rooms[d] for d in devices[start:]), default=0), request.strategy, ())
        rooms[devices[current]] -= size
        placed[name] = devices[current]
    return placed


def _balanced_low_memory(request: Problem) -> dict[str, str | Place]:
    """As balanced; what does not fit lives in CPU RAM and is moved whole to a GPU for its call (model offload)."""
    return _least_moved(request, Mode.OFFLOAD)


def _balanced_ultra_low_memory(request: Problem) -> dict[str, str | Place]:
    """As balanced; what does not fit lives in CPU RAM and is streamed block by block to a GPU for its call."""
    return _least_moved(request, Mode.STREAM)


def _least_moved(request: Problem, mode: str, stay: Strategy = _balanced) -> dict[str, str | Place]:
    """All resident if balanced fits; else the set of components to move that fits and moves the fewest bytes per
    image (bytes x calls per image: the denoiser, called at every step, leaves the GPU last).

    Moving more never makes a plan need more room (a moved component costs its GPU only while it runs), so when
    moving every component does not fit, nothing does, and the error names the component that fits no GPU.
    """
    try:
        return stay(request)
    except DoesNotFitError:
        pass
    sizes, calls = dict(request.components), dict(request.calls)
    streamed = facts(mode).peak is Peak.STREAMED  # it needs room for its blocks in flight, not for all of it
    need = {n: (dict(request.in_flight).get(n) or s) if streamed else s for n, s in sizes.items()}
    largest = max(need, key=lambda n: (need[n], n))
    if _moving(request, frozenset(sizes), need, mode, stay) is None:
        side = dict(request.side_slack)  # the room a moved component has: less its copies' pool slack
        raise DoesNotFitError(largest, sizes[largest], max(r - side.get(d, 0) for d, r in request.rooms),
                              request.strategy, ())
    fitting = (p for p in (_moving(request, m, need, mode, stay) for m in _candidates(sizes, calls)) if p is not None)
    if not streamed or not request.trees:
        return next(fitting)
    # a streamed component keeps resident what its room allows, so moving one more rarely-called component can
    # leave the denoiser room to move far less: weigh the cheapest few sets by the bytes their layouts move
    first = list(itertools.islice(fitting, WEIGHED))
    return min(first, key=lambda placed: _bytes_per_image(request, placed))


WEIGHED = 8  # fitting sets of components to move weighed by their layouts' bytes per image (cheapest by size first)


def _bytes_per_image(request: Problem, placed: Mapping[str, str | Place]) -> int:
    """Bytes a placement moves per image: each streamed component's non-resident pieces at each of its calls."""
    sizes, calls, trees = dict(request.components), dict(request.calls), dict(request.trees)
    rooms = dict(request.rooms)
    for name, place in placed.items():
        if not _streams(place):
            _charge(rooms, place, sizes[name])
    streams: dict[str, list[str]] = {}
    for name, place in placed.items():
        if isinstance(place, Place) and _streams(place):
            streams.setdefault(place.execution_device, []).append(name)
    total = 0
    for device, names in streams.items():
        layouts = stream_pieces(names, trees, sizes, calls, dict(request.in_flight), rooms[device], 0)
        total += sum(calls.get(n, 1) * (p.moved_per_call if (p := layouts[n]) else sizes[n]) for n in names)
    return total


def _streams(place: str | Place) -> bool:
    return isinstance(place, Place) and facts(place.mode).peak is Peak.STREAMED


def stream_pieces(names: list[str], trees: Mapping[str, Block | None], sizes: Mapping[str, int],
                   calls: Mapping[str, int], in_flight: Mapping[str, int], room: int, offloaded: int
                   ) -> dict[str, Pieces | None]:
    """The layouts of the components streamed to one GPU with ``room`` bytes beside its residents (and ``offloaded``
    bytes, the largest component offloaded there): the most called keeps pieces resident, leaving what the others
    need for their calls; the others stream in the room that leaves, none of their pieces resident."""
    order = sorted(names, key=lambda n: (-calls.get(n, 1), -sizes[n], n))
    others = max([0, *((in_flight.get(n) or sizes[n]) for n in order[1:])])
    layouts: dict[str, Pieces | None] = {}
    kept, room = 0, room - offloaded  # an offloaded component may stay onloaded while these run
    for index, name in enumerate(order):
        tree = trees.get(name)
        cap = room - others if index == 0 else 0
        layouts[name] = pieces = cut(tree, room - kept, max(0, cap)) if tree is not None else None
        kept += pieces.resident_bytes if pieces else 0
    return layouts


def _candidates(sizes: Mapping[str, int], calls: Mapping[str, int]) -> list[frozenset[str]]:
    """Sets of components to move, cheapest first: bytes moved per image, then fewer components, then by name."""
    def cost(names) -> tuple:
        return sum(sizes[n] * calls.get(n, 1) for n in names), len(names), sorted(names)

    names = sorted(sizes, key=lambda n: cost([n]))
    if len(names) > MAX_SEARCHED:
        return [frozenset(names[:k]) for k in range(1, len(names) + 1)]
    subsets = (c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k))
    return [frozenset(c) for c in sorted(subsets, key=cost)]


def _moving(request: Problem, moved: frozenset[str], need: Mapping[str, int], mode: str, stay: Strategy = _balanced
            ) -> dict[str, str | Place] | None:
    """The rest placed by balanced, each moved component run on the GPU with the most room left (a GPU's peak is
    its residents plus the one moved component running there); None if it does not fit."""
    rest = tuple(c for c in request.components if c[0] not in moved)
    try:
        placed: dict[str, str | Place] = dict(stay(replace(request, components=rest)))
    except DoesNotFitError:
        return None
    rooms = dict(request.rooms)
    for name, size in rest:
        _charge(rooms, placed[name], size)
    gpu = _roomiest(rooms)
    if any(need[n] + dict(request.side_slack).get(gpu, 0) > rooms[gpu] for n in moved):
        return None
    placed.update({n: Place("cpu", mode, gpu) for n in moved})
    return placed


def _charge(rooms: dict[str, int], place: str | Place, size: int) -> None:
    """Take a placed component's bytes off the rooms of the GPUs it lives on."""
    if isinstance(place, str):
        rooms[place] -= size
        return
    rooms[place.device] -= size - sum(b for _, _, b in place.shards)
    for _, device, block in place.shards:
        rooms[device] -= block
    for device in place.replicas:
        rooms[device] -= size


def _balanced_split(request: Problem) -> dict[str, str | Place]:
    """As balanced; a component that fits no GPU whole is cut between its blocks across the GPUs with the most
    room (largest first), its inputs and outputs staying on the first of them."""
    rooms = dict(request.rooms)
    blocks = dict(request.blocks)
    placed: dict[str, str | Place] = {}
    for name, size in sorted(request.components, key=lambda c: (-c[1], c[0])):
        order = sorted(rooms, key=lambda d: (-rooms[d], list(rooms).index(d)))
        if size <= rooms[order[0]]:
            rooms[order[0]] -= size
            placed[name] = order[0]
            continue
        placed[name] = _split_across(name, size, blocks.get(name, ()), order, rooms, request.strategy)
    return placed


def _split_across(name: str, size: int, blocks: tuple[tuple[str, int], ...], order: list[str], rooms: dict[str, int],
         strategy: str) -> Place:
    """Fill the roomiest GPU with the component's loose tensors and as many blocks as fit, then the next GPU."""
    home, shards = order[0], []
    largest = rooms[home]  # the room the error names: what one GPU had left before this component's pieces
    left = size - sum(b for _, b in blocks)  # what is not in a block stays home
    if left > rooms[home] or not blocks:
        raise DoesNotFitError(name, size, rooms[home], strategy, ())
    rooms[home] -= left
    devices = iter(order)
    device = next(devices)
    for path, block in blocks:
        while block > rooms[device]:
            following = next(devices, None)
            if following is None:
                raise DoesNotFitError(name, size, largest, strategy, ())
            device = following
        rooms[device] -= block
        if device != home:
            shards.append((path, device, block))
    return Place(home, Mode.SPLIT, home, tuple(shards))


def _parallel(request: Problem) -> dict[str, str | Place]:
    """A copy of the denoiser on as many GPUs as can hold one beside the rest (as many as its mode uses:
    ``replication.copy_counts``), placed around them as balanced places them; each call then runs across the copies
    as its mode says (``replication``). Balanced where no two GPUs can (``notes`` say why)."""
    for name, mode in request.parallel:
        counts = replication.copy_counts(mode, len(request.rooms), request.heads)
        # two experts (Wan 2.2) run one after the other, each at its own steps: both copied where both fit
        for names in dict.fromkeys(((name, *_partners(request, name)), (name,))):
            for count in counts if name in dict(request.components) else ():
                placed = _replicated(request, names, count, mode)
                if placed is not None:
                    return placed
    return _balanced(request)


def _partners(request: Problem, name: str) -> tuple[str, ...]:
    """The other expert of a two-expert denoiser (``experts.EXPERTS``) among the components to place."""
    present = dict(request.components)
    return tuple(e for e in EXPERTS if e != name and e in present) if name in EXPERTS else ()


def _replicated(request: Problem, names: str | tuple[str, ...], count: int, mode: str = Mode.REPLICATED
                ) -> dict[str, str | Place] | None:
    """``names`` (one component or several) each on the ``count`` roomiest GPUs, the rest balanced in what is left;
    None if that does not fit."""
    names = (names,) if isinstance(names, str) else names
    size = sum(dict(request.components)[name] for name in names)
    rooms = dict(request.rooms)
    chosen = sorted(rooms, key=lambda d: (-rooms[d], list(rooms).index(d)))[:count]
    if any(size > rooms[d] for d in chosen):
        return None
    for device in chosen:
        rooms[device] -= size
    rest = tuple(c for c in request.components if c[0] not in names)
    try:
        placed: dict[str, str | Place] = dict(_balanced(replace(request, components=rest, rooms=tuple(rooms.items()))))
    except DoesNotFitError:
        return None
    for name in names:
        placed[name] = Place(chosen[0], mode, chosen[0], (), tuple(chosen[1:]))
    return placed


STRATEGIES: dict[str, Strategy] = {"balanced": _balanced, "sequential": _sequential,
                                   "balanced_low_memory": _balanced_low_memory,
                                   "balanced_ultra_low_memory": _balanced_ultra_low_memory,
                                   "balanced_split": _balanced_split, "parallel": _parallel}
# what "auto" weighs besides STRATEGIES: splitting what fits no GPU whole, and moving the least-called of the rest
MIXED: dict[str, Strategy] = {
    "balanced_split+low_memory": lambda r: _least_moved(r, Mode.OFFLOAD, _balanced_split),
    "balanced_split+ultra_low_memory": lambda r: _least_moved(r, Mode.STREAM, _balanced_split),
}


def budgets(hw: Hardware, headroom=None) -> dict[str, int]:
    """Each device's budget: its memory less the headroom (a fraction of each GPU, bytes, or a per-device dict), and
    on a GPU less the caching allocator's slack of its default stream's pool (``modes.pool_slack``; a moved
    component's side stream keeps as much again on the GPU it runs on: ``_assemble``).

    A dict sets the devices it names; the GPUs it leaves out keep the default 10%, the CPU its own default (10%, at
    most 4 GiB, none under 2 GiB: ``_cpu_headroom``), which a number given for the GPUs leaves as it is. A float or
    a string with a decimal point (``"0.1"``) is a fraction; an int, or a string of digits with or without a unit
    (``"2GiB"``, ``"100"``), is bytes.
    """
    check_headroom(headroom)
    given = {real_device(k): v for k, v in headroom.items()} if isinstance(headroom, Mapping) else {}
    for name in given:
        if name not in hw.names:
            raise UnknownDeviceError(name, hw.names)
    default = DEFAULT_HEADROOM if headroom is None or given else headroom
    return {d.name: max(0, d.memory - _reserve(d.memory, given.get(d.name, default if is_accelerator(d.name) else
                                                                   _cpu_headroom(d.memory)))
                        - (pool_slack(d.memory) if is_accelerator(d.name) else 0))
            for d in hw.devices}


def _cpu_headroom(memory: int) -> int:
    return min(int(memory * DEFAULT_CPU_HEADROOM), CPU_HEADROOM_CAP) if memory >= CPU_HEADROOM_FROM else 0


def check_headroom(headroom) -> None:
    """Raise ``HeadroomError`` for a headroom ``budgets`` would refuse, without any hardware."""
    if headroom is None:
        return
    values = headroom.values() if isinstance(headroom, Mapping) else (headroom,)
    if isinstance(headroom, Mapping):
        for key in headroom:
            real_device(key)
    for value in values:
        _reserve(1 << 30, value)


def _reserve(memory: int, headroom: float | int | str) -> int:
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float, str)):
        raise HeadroomError(headroom, f"a {type(headroom).__name__} is no headroom")
    if isinstance(headroom, str) and _FRACTION.match(headroom):
        headroom = float(headroom)  # "0.1" is a fraction as 0.1 is; "100" is bytes as 100 is
    if isinstance(headroom, float):
        if not 0 <= headroom < 1:
            raise HeadroomError(headroom, "a fraction must be at least 0 and below 1 (for bytes, write a unit: '2GiB')")
        return int(memory * headroom)
    try:
        return min(memory, parse_bytes(headroom))
    except ValueError as err:
        raise HeadroomError(headroom, str(err)) from err


def plan_inventory(inventory: Inventory, hw: Hardware, strategy: str | dict, budget: Mapping[str, int],
                   counts: Counts | None = None, work: Workload | None = None, ranks: str | None = None) -> Plan:
    """The plan for an inventory on given hardware and budgets; ``plan()`` without the argument handling.
    ``counts``: the call's counted work, for ``"auto"`` to price its candidates by (else the formula); ``work``: the
    call ``"auto"`` and ``"parallel"`` plan for (the pipeline's default call unless given: ``cost.workload_for``);
    ``ranks``: what will run a split's ranks (``modes.RANKS``), for ``"auto"`` to price splits as they will run
    (processes if None)."""
    if strategy == AUTO:
        return auto_plan(inventory, hw, budget, counts, work, ranks)
    sizes = {c.name: c.bytes for c in inventory.models}
    fixed = _fixed(strategy, sizes, hw) if isinstance(strategy, dict) else {}
    name = strategy if isinstance(strategy, str) else "balanced"
    rest = tuple((n, s) for n, s in sizes.items() if n not in fixed)
    rooms = _rooms_after(fixed, sizes, budget)
    gpus = tuple((d.name, rooms[d.name]) for d in hw.gpus)
    notes: list[str] = []
    placed: dict[str, str | Place]
    if not gpus:
        placed = {n: "cpu" for n, _ in rest}
        notes.append("no GPU on this machine or in the profile: every component runs on the CPU")
    else:
        calls = tuple((c.name, c.calls_per_image) for c in inventory.models)
        in_flight = tuple((c.name, c.in_flight) for c in inventory.models)
        blocks = tuple((c.name, c.blocks) for c in inventory.models)
        trees = tuple((c.name, c.tree) for c in inventory.models)
        parallel = replication.parallel_modes(inventory, hw.performance, len(gpus), work) if name == "parallel" else ()
        heads = replication.denoiser_heads(inventory)
        side = tuple((d.name, pool_slack(d.memory)) for d in hw.gpus)
        placed = _run(name, Problem(rest, gpus, name, calls, in_flight, blocks, trees, parallel, heads, side))
        if name == "parallel":
            notes += [replication.call_note(inventory, work), *replication.plan_notes(inventory, placed, work)]
    device_map = {**fixed, **placed}
    label = name if not fixed else ("map" if not rest else f"map+{name}")
    return _assemble(inventory, hw, budget, device_map, label, notes)


def _fixed(mapping: dict, sizes: Mapping[str, int], hw: Hardware) -> dict[str, str]:
    fixed = {}
    for component, device in mapping.items():
        if component not in sizes:
            raise UnknownComponentError(component, tuple(sizes))
        name = real_device(device)
        if name not in hw.names:
            raise UnknownDeviceError(device, hw.names)
        fixed[component] = name
    return fixed


def _rooms_after(fixed: Mapping[str, str], sizes: Mapping[str, int], budget: Mapping[str, int]) -> dict[str, int]:
    rooms = dict(budget)
    for component, device in fixed.items():
        if sizes[component] > rooms[device] and device != "cpu":
            raise DoesNotFitError(component, sizes[component], rooms[device], "map", (), device=device)
        rooms[device] -= sizes[component]
    return rooms


def _run(name: str, request: Problem) -> dict[str, str | Place]:
    try:
        return {**STRATEGIES, **MIXED}[name](request)
    except DoesNotFitError as err:
        others = tuple(s for s in STRATEGIES if s != name and _works(s, request))
        others += (AUTO,) if any(_works(s, request) for s in MIXED) or others else ()
        raise DoesNotFitError(err.component, err.bytes, err.largest_room, name, others) from None


def _works(strategy: str, request: Problem) -> bool:
    try:
        {**STRATEGIES, **MIXED}[strategy](replace(request, strategy=strategy))
        return True
    except DoesNotFitError:
        return False


def _assemble(inventory: Inventory, hw: Hardware, budget: Mapping[str, int], device_map: Mapping[str, str | Place],
              label: str, notes: list[str]) -> Plan:
    places = {n: Place(p, Mode.RESIDENT, p) if isinstance(p, str) else p for n, p in device_map.items()}
    placements = tuple(Placement(c.name, places[c.name].device, c.bytes, places[c.name].mode,
                                 places[c.name].execution_device, shards=places[c.name].shards,
                                 replicas=places[c.name].replicas)
                       for c in inventory.models)
    # what each device holds: a split component's blocks away from its first GPU, a whole copy on each replica
    resident = {d.name: sum(held(p, d.name) for p in placements) for d in hw.devices}
    components = {c.name: c for c in inventory.models}
    # the side stream of a moved component's copies keeps an allocator pool's slack on the GPU it runs on
    budget = {d.name: max(0, budget[d.name] - side_slack(placements, d.name, d.memory)) for d in hw.devices}
    placements = _with_rooms(placements, components, budget, resident)
    # RAM is a budget too: what cannot stay in its files must fit it (``tiers``), the rest is read from the disk
    placements, staging = place_tiers(placements, components, budget.get("cpu", 0), label)
    # a GPU's peak: its residents, the largest component onloaded there, the largest blocks in flight there; the
    # CPU's: the host copies in RAM and the staging buffers
    used = {d: device_use(placements, d) for d in resident}
    used["cpu"] += staging
    devices = tuple(DeviceUse(d.name, d.memory, budget[d.name], used[d.name]) for d in hw.devices)
    return Plan(label, placements, devices, execution_device(placements), inventory.dtype, inventory.variant,
                tuple(notes), staging=staging, performance=hw.performance)


def _with_rooms(placements: tuple[Placement, ...], components: Mapping[str, Component], budget: Mapping[str, int],
                resident: Mapping[str, int]) -> tuple[Placement, ...]:
    """Each streamed component's pieces, residency and bytes in flight (``room``), from the room its GPU has beside
    its residents; each offloaded component's room (its GPU's budget less residents, the streamed components'
    resident pieces and the largest stream in flight there)."""
    layouts: dict[str, Pieces | None] = {}
    for device in {p.execution_device for p in placements if _peak(p) is Peak.STREAMED}:
        names = [p.component for p in placements if _peak(p) is Peak.STREAMED and p.execution_device == device]
        offloaded = max((p.bytes for p in placements if _peak(p) is Peak.ONLOADED and p.execution_device == device),
                        default=0)
        layouts.update(stream_pieces(names, {n: components[n].tree for n in names},
                                      {n: components[n].bytes for n in names},
                                      {n: components[n].calls_per_image for n in names},
                                      {n: components[n].in_flight for n in names},
                                      budget[device] - resident[device], offloaded))
    streamed = [_streamed(p, components[p.component], layouts.get(p.component)) if _peak(p) is Peak.STREAMED
                else p for p in placements]
    out = []
    for p in streamed:
        if _peak(p) is Peak.ONLOADED:
            d = p.execution_device
            there = [s for s in streamed if _peak(s) is Peak.STREAMED and s.execution_device == d]
            kept = sum(s.resident_bytes for s in there)
            p = replace(p, room=max(0, budget[d] - resident[d] - kept - max((s.room for s in there), default=0)))
        out.append(p)
    return tuple(out)


def _streamed(p: Placement, component: Component, found: Pieces | None) -> Placement:
    if found is None:  # no module tree (an inventory built by hand): its top-level blocks, none resident
        return replace(p, room=min(component.in_flight or component.bytes, component.bytes))
    return replace(p, room=found.in_flight, blocks=found.blocks, resident_blocks=found.resident,
                   resident_bytes=found.resident_bytes, prefetch=found.prefetch, granularity=found.level)


def _peak(p: Placement) -> Peak:
    return facts(p.mode).peak


def forcing_hardware(inventory: Inventory, strategy: str, gpus: int = 1, steps: int = 400) -> str:
    """The hardware spec with the largest equal GPU budget (in steps of 1/``steps`` of the pipeline) at which
    ``"balanced"`` fails and ``strategy`` fits: a machine that forces offloading, for tests and benchmarks.

    >>> forcing_hardware(pipemap.inspect("path/to/sdxl"), "balanced_low_memory")        # doctest: +SKIP
    'cuda:0=9663676416,cpu=1GiB'
    """
    total = sum(c.bytes for c in inventory.models)
    for budget in range(total, 0, -max(1, total // steps)):
        spec = ",".join(f"cuda:{i}={budget}" for i in range(gpus)) + ",cpu=1GiB"
        hardware = Hardware.parse(spec)
        if not _fits(inventory, hardware, "balanced") and _fits(inventory, hardware, strategy):
            return spec
    raise DoesNotFitError(max(inventory.models, key=lambda c: c.bytes).name, total, 0, strategy, ())


def _fits(inventory: Inventory, hardware: Hardware, strategy: str) -> bool:
    try:
        plan_inventory(inventory, hardware, strategy, budgets(hardware, 0.0))
        return True
    except DoesNotFitError:
        return False


def auto_plan(inventory: Inventory, hw: Hardware, budget: Mapping[str, int], counts: Counts | None = None,
              work: Workload | None = None, ranks: str | None = None) -> Plan:
    """The fastest plan that fits: every strategy's plan, priced by the cost model, the quickest kept.

    The plan carries every candidate (``plan.explain()``): its predicted seconds per image, its per-device peaks,
    or why it does not fit, and says what priced them: the call's counted work (``counts``) or the formula, at the
    call ``work`` (the pipeline's default call unless given), its splits' ranks run by ``ranks`` (threads launch one
    after the other: ``cost.rank_launch_seconds``).
    """
    candidates, plans = [], {}
    for name in (*STRATEGIES, *MIXED):
        try:
            plans[name] = with_ranks(plan_inventory(inventory, hw, name, budget, work=work), ranks or "process")
        except DoesNotFitError as err:
            candidates.append(Candidate(name, None, (), f"{err.component} does not fit"))
            continue
        seconds = seconds_per_image(plans[name], inventory, hw.performance, work, counts=counts)
        peaks = tuple((d.device, d.used) for d in plans[name].devices if d.used)
        rate = images_per_second(plans[name], inventory, hw.performance, work, counts=counts)
        candidates.append(Candidate(name, seconds, peaks, "", rate))
    # a plan that cuts calls across GPUs is kept only when it is faster than every plan that does not: at a tie the
    # extra ranks, processes and collectives buy nothing
    fitting = sorted((c for c in candidates if c.seconds is not None),
                     key=lambda c: (c.seconds or 0.0, _splits_calls(plans[c.strategy])))
    if not fitting:
        largest = max(inventory.models, key=lambda c: c.bytes)
        room = max((budget[d.name] for d in hw.gpus), default=0)
        raise DoesNotFitError(largest.name, largest.bytes, room, AUTO, ())
    fastest = fitting[0]
    fitting = _least_moving_first(fitting, plans, inventory)
    best = plans[fitting[0].strategy]
    if fitting[0] is fastest:
        why = f"auto: {fastest.strategy} is the fastest plan that fits ({fastest.seconds:.3g} s per image"
        why += f"; next {fitting[1].strategy} at {fitting[1].seconds:.3g} s)" if len(fitting) > 1 else ")"
    else:
        why = (f"auto: {fitting[0].strategy} ({fitting[0].seconds:.3g} s per image), within {TIE:.0%} of the "
               f"fastest ({fastest.strategy}, {fastest.seconds:.3g} s), moves the fewest bytes between devices an "
               f"image ({format_bytes(_moved(best, inventory))} against "
               f"{format_bytes(_moved(plans[fastest.strategy], inventory))})")
    bound = launch_note(predict(best, inventory, hw.performance, work, counts=counts), hw.performance)
    disk = (f"auto: the disk tier priced at {hw.performance.disk_text}",) if best.host.disk else ()
    called = work or workload_for(inventory)
    shape = (f"auto: priced for the {'call' if work is not None else 'default call'} {called.describe()}",)
    notes = (priced_by(counts), *shape, *((f"auto: {bound}",) if bound else ()), why, *disk)
    return replace(best, strategy=AUTO, candidates=tuple(candidates), notes=best.notes + notes, ranks=None,
                   ranks_asked=False)


TIE = 0.03  # candidates priced this close are a tie: the cost model's own error on published figures is wider


def _least_moving_first(fitting: list[Candidate], plans: Mapping[str, Plan], inventory: Inventory) -> list[Candidate]:
    """``fitting`` (fastest first) with, among those priced within ``TIE`` of the fastest, the one that moves the
    fewest bytes between devices per image first (``cost.bytes_moved``: host copies and activations between GPUs),
    then the one that splits no call: a plan that streams a denoiser at every step priced as fast as
    one that copies a text encoder once (the copies hidden under compute in the model) still pins that much RAM and
    shares the link, and loses where the overlap is less than priced."""
    fastest = fitting[0].seconds or 0.0
    tied = [c for c in fitting if (c.seconds or 0.0) <= fastest * (1 + TIE)]
    chosen = min(tied, key=lambda c: (_moved(plans[c.strategy], inventory), _splits_calls(plans[c.strategy]),
                                      c.seconds or 0.0))
    return [chosen, *(c for c in fitting if c is not chosen)]


def _moved(plan: Plan, inventory: Inventory) -> int:
    return sum(bytes_moved(plan, inventory).values())


def _splits_calls(plan: Plan) -> bool:
    """Whether a plan runs some component's calls on more than one GPU (its copies: ``Placement.replicas``)."""
    return any(p.replicas for p in plan.components)


def priced_by(counts: Counts | None) -> str:
    """What the cost model priced a plan's candidates by, as the plan's note says it."""
    if counts is None:
        return ("auto: priced by the formula on parameter counts (no dry-run counts known for this pipeline: "
                "pipemap.estimate(source, plan) counts them once, and auto uses them after)")
    return f"auto: priced by the work a dry run counted ({counts.origin}, {counts.steps} steps)"


def execution_device(placements: tuple[Placement, ...]) -> str:
    """Where the pipeline's own tensors (latents, embeddings) live: the denoiser's device, so no step moves them."""
    by_name = {p.component: p for p in placements}
    for name in DENOISERS:
        if name in by_name:
            return by_name[name].execution_device
    if not placements:
        return "cpu"
    return max(placements, key=lambda p: p.bytes).execution_device
