"""``pipemap.plan``: the planner's plan, or, with ``headroom="measure"``, one whose headroom a dry run measured.

The measured headroom is composed here, above the strategies (``planner``) and the dry run (``simulate``), so
neither of those imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from . import planner
from .errors import ArgumentConflictError, ArgumentTypeError, HeadroomError, SimulationFailedError
from .hardware import Hardware
from .inventory import Inventory
from .plan import Plan
from .simulate import simulate
from .units import format_bytes


def plan(source, hardware: Hardware | str | None = None, strategy: str | Mapping | None = None,
         max_memory: Mapping | None = None, dtype=None, variant: str | None = None, headroom=None, *,
         device_map: str | Mapping | None = None, torch_dtype=None, call: Mapping | None = None) -> Plan:
    """Where each component of a pipeline goes, before anything is loaded.

    ``source`` is a pipeline folder (only headers are read), a catalog name (``pipemap catalog``), an
    ``Inventory`` or a loaded pipeline. ``strategy`` (or diffusers' name for it, ``device_map``) is one of
    ``pipemap.STRATEGIES``, ``"auto"`` (the fastest that fits), or a dict ``{component: device}`` whose missing
    components are placed by ``"balanced"``. ``headroom`` is kept free on each GPU for activations: a fraction
    (``0.1``, ``"0.1"``), bytes (an int, ``"2GiB"``), a dict per device, or ``"measure"``: the activation peak a dry
    run of the pipeline's default call measures (``call=`` gives another call, e.g. a ControlNet image), re-planned
    until the reservation is stable.

    >>> plan = pipemap.plan("path/to/sdxl", hardware="2x16GiB,cpu=64GiB", strategy={"vae": "cuda:1"},
    ...                     dtype=torch.float16, variant="fp16")                         # doctest: +SKIP
    >>> print(plan)                                                                    # doctest: +SKIP
    """
    if not (isinstance(headroom, str) and headroom.strip() == "measure"):
        if call is not None:
            raise ArgumentConflictError("call", call, "headroom", headroom, "call= is the call a dry run measures: "
                                        "pass headroom='measure' with it, or drop it")
        return planner.plan(source, hardware, strategy, max_memory, dtype, variant, headroom,
                            device_map=device_map, torch_dtype=torch_dtype)
    if call is not None and not isinstance(call, Mapping):
        raise ArgumentTypeError("call", call, "a dict of keyword arguments for the pipeline call")
    strategy = planner.resolve_strategy(strategy, device_map)
    hw = planner.resolve_hardware(hardware, max_memory)
    inventory = planner.inspect(source, dtype, variant, torch_dtype=torch_dtype)
    return measured_plan(source, inventory, hw, strategy, call or {})


def measured_plan(source, inventory, hw, strategy, call: Mapping, rounds: int = 4) -> Plan:
    """The plan whose headroom on each device covers the activation peak a dry run of ``call`` measures there.

    Placement changes what runs where, so it re-plans with the measured figures until a plan's own dry run fits
    its reservations; each device keeps the largest figure seen, so two layouts cannot take turns for ever.
    """
    if isinstance(source, Inventory):
        raise HeadroomError("measure", "a dry run needs a pipeline folder or a loaded pipeline, not an Inventory")
    current = planner.plan_inventory(inventory, hw, strategy, planner.budgets(hw))
    reserve: dict[str, int] = {}
    for _ in range(rounds):
        report = simulate(source, current, **call)
        if not report.ok:
            raise SimulationFailedError(report)
        if reserve and all(v <= reserve.get(d, 0) for d, v in report.activation_bytes.items()):
            break
        reserve = {d: max(reserve.get(d, 0), report.activation_bytes.get(d, 0)) for d in hw.names}
        current = planner.plan_inventory(inventory, hw, strategy, planner.budgets(hw, reserve))
    note = "headroom measured by a dry run: " + ", ".join(f"{d} {format_bytes(b)}" for d, b in reserve.items())
    return replace(current, notes=current.notes + (note,))
