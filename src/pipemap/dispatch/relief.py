"""Out of memory inside a component's call: the least-used resident components of that device moved to the host,
so the call can be retried (``admission.Admission`` retries it once, with every other component call held back).

A moved component is offloaded, as a plan at a smaller budget would have it: its weights live in CPU RAM and are
onloaded to its device for its own calls only (an offload room of 0: the GPU keeps none of it between them). What
leaves first is what was called least since dispatch (a text encoder runs once per prompt, the denoiser every step),
and as many leave as free what the call tried to allocate, or at least its own reservation there. The move is all or
nothing: if placing any tensor fails, every tensor moved goes back and the old hooks return; the plan's notes say
what moved and why.

The host is held to its budget as a GPU is: a component moves only if the plan's CPU budget has room for it beside
what the plan already puts there (a moved component is pinned, whole). When a component on the device would free
memory but none fits in that room, nothing moves and the call fails with its out-of-memory error, with a note of
the figures (a relief with no ``moved``): a retry that would take the host past its budget would trade one request's
error for the kernel's OOM killer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import DispatchError
from ..hooks import hook_component, hook_maker, unhook_component
from ..modes import Mode
from ..plan import Plan
from ..runtime.admission import OutOfMemory
from ..runtime.placed import replan
from ..units import format_bytes
from .counters import stats
from .moves import Move, place_module


@dataclass(frozen=True)
class Relief:
    """One out-of-memory move: where it hit (``component``'s call on ``device``), what moved to the host and the
    bytes that freed there, the plans after it (as planned, and as the pipeline runs), and its note."""

    component: str
    device: str
    moved: tuple[str, ...]
    freed: int
    plan: Plan
    running: Plan
    note: str


def relieve(pipe, admission, failure: OutOfMemory) -> Relief | None:
    """Move the least-used resident components of ``failure.device`` to the host; None when none is left to move,
    a relief that moved nothing when the host has no room for any (``refused``).

    >>> admission = pipemap.api.memory_for(pipe)            # run_many and serve call it on an out-of-memory error
    """
    plan, running = admission.plan, admission.running
    moved = least_used(plan, failure, stats(pipe))
    if not moved:
        return refused(plan, failure)
    freed = sum(plan.placement(name).bytes for name in moved)
    note = (f"out of memory in {failure.component!r} on {failure.device}: moved {', '.join(moved)} "
            f"({format_bytes(freed)}, least used) to the host, onloaded to {failure.device} for their own calls; "
            "the call was retried")
    after, running_after = offloaded(plan, moved, note), offloaded(running, moved, note)
    replace_placements(pipe, running_after, moved)
    return Relief(failure.component, failure.device, moved, freed, after, running_after, note)


def least_used(plan: Plan, failure: OutOfMemory, counted: dict[str, dict[str, int]]) -> tuple[str, ...]:
    """The resident components of the failing device other than the failing one, fewest calls first (then the
    largest), as many as free what the call tried to allocate or had reserved there; at least one."""
    need = max(failure.tried, failure.reserved, 1)
    there = _movable(plan, failure)
    there.sort(key=lambda p: (counted.get(p.component, {}).get("calls", 0), -p.bytes, p.component))
    room = host_room(plan)
    chosen, freed = [], 0
    for p in there:
        if freed >= need:
            break
        if room is not None and p.bytes > room:
            continue  # the host has no room for it within its budget
        chosen.append(p.component)
        freed += p.bytes
        room = None if room is None else room - p.bytes
    return tuple(chosen)


def _movable(plan: Plan, failure: OutOfMemory) -> list:
    return [p for p in plan.components if p.mode == Mode.RESIDENT and p.device == failure.device
            and p.component != failure.component and p.bytes > 0]


def host_room(plan: Plan) -> int | None:
    """The bytes the plan's CPU budget has left beside what it puts there; None where the plan has no CPU budget."""
    cpu = next((d for d in plan.devices if d.device == "cpu"), None)
    return None if cpu is None else max(0, cpu.budget - cpu.used)


def refused(plan: Plan, failure: OutOfMemory) -> Relief | None:
    """No move: None when the device has nothing to move; else a relief that moved nothing, whose note gives the
    figures (the components that could leave, and the host's room for them)."""
    there = _movable(plan, failure)
    if not there:
        return None
    room = host_room(plan) or 0
    smallest = min(there, key=lambda p: p.bytes)
    note = (f"out of memory in {failure.component!r} on {failure.device}: nothing moved to the host: the smallest "
            f"component that could leave, {smallest.component!r} ({format_bytes(smallest.bytes)}), does not fit in "
            f"the {format_bytes(room)} the CPU budget has left; plan with a larger cpu= budget, or fewer requests at "
            "once")
    return Relief(failure.component, failure.device, (), 0, plan, plan, note)


def offloaded(plan: Plan, names: tuple[str, ...], note: str) -> Plan:
    """``plan`` with the resident ``names`` offloaded to the device they lived on (room 0), its totals redone."""
    components = tuple(replace(p, device="cpu", mode=Mode.OFFLOAD, room=0) if p.component in names else p
                       for p in plan.components)
    # each device's peak as ``modes.device_use`` counts it: the largest offloaded component, onloaded for its call
    return plan.with_components(components, notes=plan.notes + (note,))


def replace_placements(pipe, plan: Plan, names: tuple[str, ...]) -> None:
    """Re-place and re-hook ``names`` as ``plan`` says, all or none: on a failure every tensor moved goes back
    and the old hooks return, and a ``DispatchError`` names the component."""
    # the hooks share the ledger of onloads and the lock of the pipeline's offloaded and streamed components, if it
    # has any (they evict each other, so they take turns)
    make = hook_maker(plan, beside=[getattr(m, "_hf_hook", None) for m in pipe.components.values()])
    done: list[tuple[object, object, list[Move]]] = []
    for name in names:
        module, placement = pipe.components[name], plan.placement(name)
        try:
            old = module._hf_hook
            unhook_component(module)
            done.append((module, old, []))
            place_module(module, placement.device, moves=done[-1][2])
            hook_component(module, make(placement))
        except Exception as err:
            _undo(done)
            raise DispatchError(name, placement.device, err) from err
    replan(pipe, plan)


def _undo(done: list) -> None:
    for module, old, moves in reversed(done):
        unhook_component(module)
        for moved in reversed(moves):
            moved.undo()
        hook_component(module, old)
