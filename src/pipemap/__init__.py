"""pipemap: place a multi-model pipeline across every GPU and the CPU RAM of a machine, and run it there."""

from .dispatch import dispatch, reset
from .errors import (
    ArgumentConflictError,
    CheckpointError,
    DispatchError,
    DoesNotFitError,
    ForeignHookError,
    HardwareSpecError,
    HeadroomError,
    MemorySpecError,
    NotAPipelineError,
    PipelineMappedError,
    PipemapError,
    PlanMismatchError,
    RunManyCallError,
    SimulationFailedError,
    UnknownComponentError,
    UnknownDeviceError,
    UnknownDtypeError,
    UnknownStrategyError,
)
from .hardware import Device, Hardware, normalize_device
from .inventory import Component, Inventory, inspect
from .loading import load
from .offload import stats
from .parallel import current_request, iter_many, run_many
from .plan import DeviceUse, Placement, Plan
from .planner import STRATEGIES, plan
from .simulate import Failure, SimulationReport, simulate
from .transfer import PipemapWarning, TransferReport, UnsafeTransferWarning, check_transfers
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "ArgumentConflictError", "CheckpointError", "Component", "Device", "DeviceUse", "DispatchError",
    "DoesNotFitError", "Hardware", "HardwareSpecError", "Inventory", "MemorySpecError", "NotAPipelineError",
    "PipelineMappedError", "PipemapError", "Placement", "Plan", "PlanMismatchError", "STRATEGIES",
    "UnknownComponentError", "UnknownDeviceError", "UnknownDtypeError", "UnknownStrategyError", "__version__",
    "dispatch", "format_bytes", "inspect", "load", "normalize_device", "parse_bytes", "plan", "reset",
    "Failure", "SimulationReport", "simulate", "PipemapWarning", "TransferReport", "UnsafeTransferWarning",
    "check_transfers", "HeadroomError", "SimulationFailedError", "stats",
    "ForeignHookError", "RunManyCallError", "current_request", "iter_many", "run_many",
]
