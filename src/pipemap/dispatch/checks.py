"""What ``dispatch`` checks before anything moves: a diffusers pipeline, a plan that places exactly its models, models
nothing else hooks, tensors offload and streaming can pack, and no stand-in device for real weights."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import ArgumentTypeError, PipelineMappedError, PlanMismatchError
from ..hooks import PlacementHook
from ..modes import facts
from ..plan import Plan
from ..quantized import movable, storage
from ..runtime.placed import planned


def components(pipe) -> dict[str, torch.nn.Module]:
    """``pipe``'s models by component name (its other components, tokenizers and schedulers, left out)."""
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def check_plan(pipe, plan: Plan, shared: bool = False) -> dict[str, torch.nn.Module]:
    """``plan`` places exactly ``pipe``'s models, which nothing else hooks (``shared``: except pipemap, for a copy's
    family about to be re-placed); returns them (``components``)."""
    check_pipeline(pipe, "dispatch")
    if not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns")
    if planned(pipe) is not None and not shared:
        raise PipelineMappedError("dispatching a pipeline that pipemap already placed")
    modules = components(pipe)
    for name, module in ({} if shared else modules).items():
        _check_unhooked(name, module)
    planned_names = {p.component for p in plan.components}
    for name in modules:
        if name not in planned_names:
            raise PlanMismatchError(name, "the pipeline has this model but the plan does not place it; re-plan from "
                                    "this pipeline (pipemap.plan(pipe, ...)) or add it to the device map")
    for name in planned_names:
        if name not in modules:
            raise PlanMismatchError(name, f"the plan places it but the pipeline has no such model (it has: "
                                    f"{', '.join(modules)})")
    check_standins(modules, plan)
    for p in plan.components:
        if facts(p.mode).moves_weights:
            _check_movable(p.component, modules[p.component])
    return modules


def _check_unhooked(name: str, module: torch.nn.Module) -> None:
    if isinstance(getattr(module, "_hf_hook", None), PlacementHook):
        raise PlanMismatchError(name, "pipemap placed it for another pipeline that shares it (a copy made with "
                                "from_pipe or from its components): pipemap.follow(pipe) places this one on "
                                "that plan; to plan anew, pipemap.reset(pipe) (both are reset) and dispatch")
    if getattr(module, "_hf_hook", None) is not None:
        raise PlanMismatchError(name, f"it already carries the hook {type(module._hf_hook).__name__} (from "
                                "enable_model_cpu_offload or a device_map); call pipe.remove_all_hooks() first")


def _check_movable(name: str, module: torch.nn.Module) -> None:
    for path, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not movable(tensor):
            raise PlanMismatchError(name, f"its tensor {path} is a {type(tensor).__name__}, which offload and "
                                    "streaming cannot pack (it keeps state outside its storage); place it resident "
                                    f"(strategy={{{name!r}: 'cuda:0'}}) or quantize it with torchao or quanto")


def check_pipeline(pipe, operation: str) -> None:
    """A diffusers pipeline (anything with a ``components`` dict), or an ``ArgumentTypeError`` naming ``operation``.
    A diffusers pipeline class (its ``components`` a property) passes without building the dict: diffusers
    builds it anew at each read, from the signature of ``__init__`` (issue 38: load time)."""
    kind = type(pipe)
    if getattr(kind, "config_name", None) == "model_index.json" and isinstance(getattr(kind, "components", None),
                                                                               property):
        return
    if not isinstance(getattr(pipe, "components", None), dict):
        raise ArgumentTypeError(f"{operation}(pipe)", pipe, "a loaded diffusers pipeline (DiffusionPipeline)")


def check_standins(modules: dict[str, torch.nn.Module], plan: Plan) -> None:
    """A plan on stand-in devices (``meta:N``) applies only to a dry run's fake weights: moving real weights to the
    meta device would destroy them."""
    for p in plan.components:
        devices = (p.device, p.execution_device, *(d for _, d, _ in p.shards))
        if any(d.startswith("meta") for d in devices):
            tensor = next(modules[p.component].parameters(), None)
            if tensor is not None and not isinstance(storage(tensor)[0], FakeTensor):  # a quantized one: its data
                raise PlanMismatchError(p.component, "the plan puts it on a dry run's stand-in device (meta), which "
                                        "holds no data: its weights would be lost. Plan for real devices")
