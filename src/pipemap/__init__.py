"""pipemap: place a multi-model pipeline across every GPU and the CPU RAM of a machine, and run it there.

Names are imported on first use (module ``__getattr__``, PEP 562): ``import pipemap`` and the command line's
``--help`` then start in a fraction of a second, and diffusers, transformers and accelerate are imported only by
the functions that need them.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from .errors import (
    ArgumentConflictError,
    ArgumentTypeError,
    CallArgumentError,
    CallTooLargeError,
    CannotTravelError,
    CheckpointError,
    ComponentChangedError,
    DecimalSizeWarning,
    DispatchError,
    DoesNotFitError,
    FolderNotEmptyError,
    ForeignHookError,
    HardwareSpecError,
    HeadroomError,
    HostMemoryError,
    MemorySpecError,
    NotAPipelineError,
    OutputPathError,
    PipelineMappedError,
    PipemapError,
    PipemapWarning,
    PlanFormatError,
    PlanMismatchError,
    RanksFallbackWarning,
    RanksSelfTestError,
    RayPlacementError,
    RunManyCallError,
    SimulationFailedError,
    UnknownComponentError,
    UnknownDeviceError,
    UnknownDtypeError,
    UnknownStrategyError,
    UnsafeTransferWarning,
    VariantNotFoundError,
    WeightsFileChangedError,
    WorkerCallError,
    WorkerDiedError,
    WorkersOptionError,
)
from .quiet import quiet_imports
from .units import format_bytes, parse_bytes

quiet_imports()  # before torch, torchao and transformers are imported: their import-time noise (quiet.NOISE)

__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "plan": "api", "inspect": "api", "load": "api", "simulate": "api", "estimate": "api", "Request": "api",
    "Estimate": "api", "simulate_many": "api", "run_many": "api", "iter_many": "api",
    "dispatch": "dispatch", "reset": "dispatch", "stats": "dispatch", "replace": "dispatch", "follow": "dispatch",
    "replace_component": "dispatch",
    "normalize_device": "devices", "Device": "hardware", "Hardware": "hardware",
    "Component": "inventory.values", "Inventory": "inventory.values",
    "current_request": "dispatch.parallel",
    "DeviceUse": "plan", "HostUse": "plan", "Placement": "plan", "Plan": "plan",
    "Mode": "modes",
    "STRATEGIES": "planner",
    "Failure": "dryrun.report", "SimulationReport": "dryrun.report", "ManyReport": "dryrun.many",
    "TransferReport": "runtime.transfer", "check_transfers": "runtime.transfer",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'pipemap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing the submodule ``pipemap.plan`` sets the package's attribute ``plan`` to that module; the functions
    ``plan`` and ``dispatch`` share their modules' names and must not be hidden by them."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # for type checkers and IDEs: the names above, imported eagerly
    from .api import Estimate, Request, estimate, inspect, iter_many, load, plan, run_many, simulate, simulate_many
    from .devices import normalize_device
    from .dispatch import dispatch, follow, replace, replace_component, reset, stats
    from .dispatch.parallel import current_request
    from .dryrun.many import ManyReport
    from .dryrun.report import Failure, SimulationReport
    from .hardware import Device, Hardware
    from .inventory.values import Component, Inventory
    from .modes import Mode
    from .plan import DeviceUse, HostUse, Placement, Plan
    from .planner import STRATEGIES
    from .runtime.transfer import TransferReport, check_transfers

__all__ = [
    "ArgumentConflictError", "ArgumentTypeError", "CallArgumentError", "CheckpointError", "Component", "Device",
    "ComponentChangedError", "follow", "replace", "replace_component",
    "FolderNotEmptyError", "ForeignHookError", "RunManyCallError", "OutputPathError",
    "DecimalSizeWarning", "DeviceUse", "DispatchError", "DoesNotFitError", "Hardware", "HardwareSpecError",
    "Inventory", "MemorySpecError",
    "NotAPipelineError", "PipelineMappedError", "PipemapError", "Placement", "Plan", "PlanFormatError",
    "PlanMismatchError", "STRATEGIES", "UnknownComponentError", "UnknownDeviceError", "UnknownDtypeError",
    "UnknownStrategyError", "VariantNotFoundError", "__version__", "dispatch", "format_bytes", "inspect", "load",
    "normalize_device", "parse_bytes", "plan", "reset", "Failure", "SimulationReport", "simulate", "PipemapWarning",
    "TransferReport", "UnsafeTransferWarning", "check_transfers", "HeadroomError", "SimulationFailedError", "stats",
    "current_request", "iter_many", "run_many", "estimate", "Estimate", "Request",
    "simulate_many", "ManyReport", "CallTooLargeError", "HostMemoryError", "HostUse", "WeightsFileChangedError",
    "WorkerCallError", "WorkerDiedError", "WorkersOptionError", "RayPlacementError", "CannotTravelError",
    "RanksFallbackWarning", "RanksSelfTestError",
    "Mode",
]
