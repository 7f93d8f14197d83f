"""``plan()``: decide where each component goes. Pure: it reads headers or module sizes and moves nothing.

Each strategy is one small function from a ``Request`` (the components' sizes, each GPU's room) to
``{component: device}``; the code around it validates input, applies dict maps and totals the budgets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import (
    ArgumentConflictError,
    DoesNotFitError,
    HeadroomError,
    UnknownComponentError,
    UnknownDeviceError,
    UnknownStrategyError,
)
from .hardware import Hardware, is_accelerator, normalize_device
from .inventory import Inventory, inspect
from .plan import DeviceUse, Placement, Plan
from .units import parse_bytes

DEFAULT_HEADROOM = 0.10  # of each GPU's memory, kept for activations until a dry run measures them
DENOISERS = ("transformer", "unet", "prior", "decoder", "transformer_2")


@dataclass(frozen=True)
class Request:
    """What a strategy sees: components ``(name, bytes)`` in pipeline order and the room left on each GPU."""

    components: tuple[tuple[str, int], ...]
    rooms: tuple[tuple[str, int], ...]
    strategy: str


Strategy = Callable[[Request], dict[str, str]]


def _balanced(request: Request) -> dict[str, str]:
    """Largest first, each to the GPU with the most room left: the fullest GPU ends as empty as it can be."""
    rooms = dict(request.rooms)
    placed = {}
    for name, size in sorted(request.components, key=lambda c: (-c[1], c[0])):
        device = max(rooms, key=lambda d: (rooms[d], -list(rooms).index(d)))
        if size > rooms[device]:
            raise DoesNotFitError(name, size, rooms[device], request.strategy, ())
        rooms[device] -= size
        placed[name] = device
    return placed


def _sequential(request: Request) -> dict[str, str]:
    """Pipeline order: fill the first GPU, then the next; never go back to an earlier one."""
    devices = [d for d, _ in request.rooms]
    rooms = dict(request.rooms)
    placed, current = {}, 0
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


STRATEGIES: dict[str, Strategy] = {"balanced": _balanced, "sequential": _sequential}


def plan(source, hardware: Hardware | str | None = None, strategy: str | Mapping | None = None,
         max_memory: Mapping | None = None, dtype=None, variant: str | None = None, headroom=None, *,
         device_map: str | Mapping | None = None, torch_dtype=None, call: Mapping | None = None) -> Plan:
    """Where each component of a pipeline goes, before anything is loaded.

    ``source`` is a pipeline folder (only headers are read), an ``Inventory`` or a loaded pipeline. ``strategy``
    (or diffusers' name for it, ``device_map``) is ``"balanced"``, ``"sequential"`` or a dict
    ``{component: device}`` whose missing components are placed by ``"balanced"``. ``headroom="measure"``
    reserves on each device the activation peak a dry run of the pipeline's default call measures (``call=``
    gives another call, e.g. a ControlNet image), re-planned until the reservation is stable.

    >>> plan = pipemap.plan("path/to/sdxl", hardware="2x16GiB,cpu=64GiB", strategy={"vae": "cuda:1"},
    ...                     dtype=torch.float16, variant="fp16")                         # doctest: +SKIP
    >>> print(plan)                                                                    # doctest: +SKIP
    """
    strategy = resolve_strategy(strategy, device_map)
    inventory = inspect(source, dtype, variant, torch_dtype=torch_dtype)
    hw = resolve_hardware(hardware, max_memory)
    if isinstance(headroom, str) and headroom == "measure":
        from .simulate import measured_plan

        return measured_plan(source, inventory, hw, strategy, call or {})
    return plan_inventory(inventory, hw, strategy, budgets(hw, headroom))


def resolve_strategy(strategy: str | Mapping | None, device_map: str | Mapping | None) -> str | dict:
    if strategy is not None and device_map is not None and strategy != device_map:
        raise ArgumentConflictError("strategy", strategy, "device_map", device_map)
    chosen = strategy if strategy is not None else device_map if device_map is not None else "balanced"
    if isinstance(chosen, Mapping):
        return dict(chosen)
    if not isinstance(chosen, str) or chosen not in STRATEGIES:
        raise UnknownStrategyError(chosen, tuple(STRATEGIES) + ("a dict {component: device}",))
    return chosen


def resolve_hardware(hardware: Hardware | str | None, max_memory: Mapping | None) -> Hardware:
    hw = Hardware.parse(hardware) if isinstance(hardware, str) else hardware or Hardware.detect()
    return hw.with_max_memory(max_memory) if max_memory else hw


def budgets(hw: Hardware, headroom=None) -> dict[str, int]:
    """Each device's budget: its memory less the headroom (a fraction of each GPU, bytes, or a per-device dict).

    A dict sets the devices it names; the GPUs it leaves out keep the default 10%, the CPU none.
    """
    given = {normalize_device(k): v for k, v in headroom.items()} if isinstance(headroom, Mapping) else {}
    for name in given:
        if name not in hw.names:
            raise UnknownDeviceError(name, hw.names)
    default = DEFAULT_HEADROOM if headroom is None or given else headroom
    return {d.name: d.memory - _reserve(d.memory, given.get(d.name, default if is_accelerator(d.name) else 0))
            for d in hw.devices}


def _reserve(memory: int, headroom: float | int | str) -> int:
    if isinstance(headroom, float):
        if not 0 <= headroom < 1:
            raise HeadroomError(headroom, "a fraction must be at least 0 and below 1")
        return int(memory * headroom)
    try:
        return min(memory, parse_bytes(headroom))
    except ValueError as err:
        raise HeadroomError(headroom, str(err)) from err


def plan_inventory(inventory: Inventory, hw: Hardware, strategy: str | dict, budget: Mapping[str, int]) -> Plan:
    """The plan for an inventory on given hardware and budgets; ``plan()`` without the argument handling."""
    sizes = {c.name: c.bytes for c in inventory.models}
    fixed = _fixed(strategy, sizes, hw) if isinstance(strategy, dict) else {}
    name = strategy if isinstance(strategy, str) else "balanced"
    rest = tuple((n, s) for n, s in sizes.items() if n not in fixed)
    rooms = _rooms_after(fixed, sizes, budget)
    gpus = tuple((d.name, rooms[d.name]) for d in hw.gpus)
    notes: list[str] = []
    if not gpus:
        placed = {n: "cpu" for n, _ in rest}
        notes.append("no GPU on this machine or in the profile: every component runs on the CPU")
    else:
        placed = _run(name, Request(rest, gpus, name), inventory, hw, budget, fixed)
    device_map = {**fixed, **placed}
    label = name if not fixed else ("map" if not rest else f"map+{name}")
    return _assemble(inventory, hw, budget, device_map, label, notes)


def _fixed(mapping: dict, sizes: Mapping[str, int], hw: Hardware) -> dict[str, str]:
    fixed = {}
    for component, device in mapping.items():
        if component not in sizes:
            raise UnknownComponentError(component, tuple(sizes))
        name = normalize_device(device)
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


def _run(name: str, request: Request, inventory, hw, budget, fixed) -> dict[str, str]:
    try:
        return STRATEGIES[name](request)
    except DoesNotFitError as err:
        others = tuple(s for s in STRATEGIES if s != name and _works(s, request))
        raise DoesNotFitError(err.component, err.bytes, err.largest_room, name, others) from None


def _works(strategy: str, request: Request) -> bool:
    try:
        STRATEGIES[strategy](Request(request.components, request.rooms, strategy))
        return True
    except DoesNotFitError:
        return False


def _assemble(inventory: Inventory, hw: Hardware, budget: Mapping[str, int], device_map: Mapping[str, str],
              label: str, notes: list[str]) -> Plan:
    placements = tuple(Placement(c.name, device_map[c.name], c.bytes) for c in inventory.models)
    used = {d.name: 0 for d in hw.devices}
    for p in placements:
        used[p.device] += p.bytes
    if used.get("cpu", 0) > budget.get("cpu", 0):
        notes.append(f"the CPU holds {used['cpu']} bytes, more than its {budget['cpu']} bytes of available RAM")
    devices = tuple(DeviceUse(d.name, d.memory, budget[d.name], used[d.name]) for d in hw.devices)
    return Plan(label, placements, devices, execution_device(placements), inventory.dtype, inventory.variant,
                tuple(notes))


def execution_device(placements: tuple[Placement, ...]) -> str:
    """Where the pipeline's own tensors (latents, embeddings) live: the denoiser's device, so no step moves them."""
    by_name = {p.component: p for p in placements}
    for name in DENOISERS:
        if name in by_name:
            return by_name[name].execution_device
    if not placements:
        return "cpu"
    return max(placements, key=lambda p: p.bytes).execution_device
