"""A pipeline folder loaded straight onto its plan, then dispatched (``pipemap.load`` checks its arguments in
``api`` and calls ``load_onto``).

Each model is loaded by its own library's ``from_pretrained`` with ``device_map`` set to its planned device, so
its weights go from the file to that device without a full copy in CPU RAM first; the pipeline is then assembled
by diffusers' ``DiffusionPipeline.from_pretrained`` with those models passed in, which loads only the weightless
parts (tokenizers, scheduler).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ArgumentTypeError, PlanMismatchError, UnknownDeviceError
from ..hardware import gpu_names
from ..inventory.folder import component_class
from ..inventory.live import live_component
from ..inventory.values import Component, Inventory
from ..modes import facts
from ..plan import Plan
from ..quiet import PATCHING, quiet_progress
from .placing import place


def load_onto(folder: Path, index: dict, plan: Plan, passed: dict, dtype: torch.dtype | None, variant: str | None,
              *, progress: bool = True, check_transfers: bool = True, kwargs: dict):
    """Each planned model of ``folder`` loaded onto its device, the pipeline assembled around them (with the
    components ``passed`` in built and ``kwargs`` for ``DiffusionPipeline.from_pretrained``), then dispatched.
    ``dtype`` and ``variant`` default to the plan's."""
    dtype = dtype if dtype is not None else _plan_dtype(plan)
    variant = variant if variant is not None else plan.variant
    with PATCHING, quiet_progress():
        pipe, loaded = _load_onto(folder, index, plan, passed, dtype, variant, progress, kwargs)
    # ``place``, not ``dispatch``: a pipeline just loaded is no from_pipe copy, and ``load`` gave back what placed
    # pipelines kept; ``loaded`` spares the walk of the models loaded here onto the CPU they stay on
    place(pipe, plan, check_transfers=check_transfers, loaded=loaded)
    return pipe


def check_plan_fits(plan: Plan, inventory: Inventory) -> None:
    """The plan places exactly the folder's models, on devices this machine has, as ``dispatch`` will check; here
    before any weight is loaded."""
    check_plan_models(plan, {c.name for c in inventory.models}, "folder")
    here = ["cpu", *gpu_names()]
    for p in plan.components:
        for device in (p.device, p.execution_device, *(d for _, d, _ in p.shards), *p.replicas):
            if device not in here:
                raise UnknownDeviceError(device, tuple(here), f"(where the plan puts {p.component!r}) is not on "
                                         "this machine: re-plan here, or plan.remap() it onto devices it has")


def check_plan_models(plan: Plan, models: set[str], source: str) -> None:
    """The plan places exactly the models of its ``source`` (a ``"folder"``, ``"pipeline"`` or catalog name), else
    a ``PlanMismatchError``: a plan made for another pipeline."""
    for name in sorted(models - set(plan.device_map)):
        raise PlanMismatchError(name, f"the {source} has this model but the plan does not place it: it was made for "
                                f"another pipeline; re-plan from this {source} (pipemap.plan(...))")
    for name in sorted(set(plan.device_map) - models):
        raise PlanMismatchError(name, f"the plan places it but the {source} has no such model (it has: "
                                f"{', '.join(sorted(models))}); re-plan from this {source}")


def _load_onto(folder: Path, index: dict, plan: Plan, passed: dict, dtype, variant, progress: bool, kwargs: dict):
    """Each planned model loaded onto its device, then the pipeline assembled around them; with the names of the
    models loaded here (the others diffusers loaded, or the caller passed in)."""
    kwargs = dict(kwargs)
    kernels = kwargs.pop("use_kernels", False)
    models = {}
    for placement in tqdm(plan.components, desc="pipemap: loading", unit="model", disable=not progress):
        library, class_name = index[placement.component]
        if placement.component not in passed and not _custom_code(library):
            models[placement.component] = load_component(
                folder, placement.component, library, class_name, _load_device(placement), dtype, variant,
                trust_remote_code=kwargs.get("trust_remote_code", False), use_kernels=kernels)
    from diffusers import DiffusionPipeline  # here, not at import: it pulls in every pipeline class

    extra = {"dtype": dtype} if dtype is not None else {}
    return (DiffusionPipeline.from_pretrained(folder, **models, **passed, variant=variant, **extra, **kwargs),
            frozenset(models))


def load_component(folder: Path, name: str, library: str, class_name: str, device: str,
                   dtype: torch.dtype | None, variant: str | None, *,
                   trust_remote_code: bool = False, use_kernels: bool = False) -> torch.nn.Module:
    """One model loaded by its library onto ``device`` (``device_map=device``), at ``dtype`` if given; a custom
    class in the component's folder only with ``trust_remote_code``, as diffusers asks.

    A transformers model is loaded with ``use_kernels`` (False unless the caller passes ``use_kernels=True``):
    transformers 5.25 kernelizes by default a model loaded with a GPU ``device_map``, swapping layers for kernels
    fetched from the Hub. A plain diffusers pipeline loads on the CPU and is moved, so it keeps PyTorch's layers;
    kernelizing here would change its outputs, and fail offline (``HF_HUB_OFFLINE=1``) where diffusers loads."""
    cls = component_class(library, class_name, folder, name, trust_remote_code)
    options: dict[str, Any] = {}
    if library == "transformers":
        options["use_kernels"] = use_kernels
    if device != "cpu":  # the CPU is where from_pretrained loads anyway; a device_map there only adds a dispatch
        options["device_map"] = device
    if dtype is not None:
        options["dtype"] = dtype
    if variant is not None and _has_variant(folder / name, variant):
        options["variant"] = variant
    # the subfolder's own path, as diffusers' pipeline loader passes it (``load_sub_model``): from the folder with
    # ``subfolder=`` each library resolves every file it looks for anew (2% of a tiny load, issue 38)
    return cls.from_pretrained(folder / name, **options)


def _custom_code(library: str) -> bool:
    """Whether ``library`` names custom code in the component's folder. diffusers refuses such a component passed in
    built (it checks a passed model against its library by importing the name), so it is left to diffusers to load,
    in CPU RAM; dispatch then moves it to its planned device."""
    from diffusers import pipelines
    from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES

    return library not in LOADABLE_CLASSES and not hasattr(pipelines, library)


def check_passed(index: dict, passed: dict) -> None:
    """Each component passed in built (``load(path, unet=...)``) is of the kind its ``model_index.json`` entry names
    (diffusers' own check, before any weight loads), else an ``ArgumentTypeError`` naming it; None leaves an
    optional one out, as in diffusers."""
    from diffusers.pipelines.pipeline_loading_utils import ALL_IMPORTABLE_CLASSES, maybe_raise_or_warn

    for name, value in passed.items():
        entry = index.get(name)
        if value is None or not isinstance(entry, list) or entry[0] is None or _custom_code(entry[0]):
            continue
        library, class_name = entry
        try:
            maybe_raise_or_warn(library, None, class_name, ALL_IMPORTABLE_CLASSES, passed, name, False)
        except ValueError as err:
            expected = re.sub(r"<class '([^']+)'>", r"\1", str(err).rpartition(" but should be ")[2]) or "its base"
            raise ArgumentTypeError(name, value, f"a built component of the kind model_index.json names for "
                                    f"{name!r} ({library} {class_name}, an instance of {expected}), or None to "
                                    "leave an optional component out") from None


def with_passed(inventory: Inventory, passed: dict) -> Inventory:
    """The inventory with components the user passed in already built, sized from their modules."""
    components = []
    for component in inventory.components:
        value = passed.get(component.name, component)
        if isinstance(value, torch.nn.Module):
            component = live_component(component.name, value)
        elif component.name in passed:
            component = Component(component.name, component.library, component.class_name)
        components.append(component)
    return Inventory(inventory.source, inventory.pipeline_class, tuple(components), inventory.dtype,
                     inventory.variant)


def _load_device(placement) -> str:
    # offloaded and streamed models live in CPU RAM; a split one is loaded there too and dispatch then moves each
    # part to its GPU, since loading it whole onto its first GPU is what it was split for not fitting; the copies of
    # the modes that keep one are made at dispatch
    return placement.device if facts(placement.mode).loads_on == "device" else "cpu"


def _plan_dtype(plan: Plan) -> torch.dtype | None:
    return getattr(torch, plan.dtype) if plan.dtype else None


def _has_variant(subfolder: Path, variant: str) -> bool:
    return any(f".{variant}." in p.name or f".{variant}-" in p.name for p in subfolder.glob("*.safetensors"))
