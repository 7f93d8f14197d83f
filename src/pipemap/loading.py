"""``load()``: a pipeline folder loaded straight onto its plan, then dispatched.

Each model is loaded by its own library's ``from_pretrained`` with ``device_map`` set to its planned device, so
its weights go from the file to that device without a full copy in CPU RAM first; the pipeline is then assembled
by diffusers' ``DiffusionPipeline.from_pretrained`` with those models passed in, which loads only the weightless
parts (tokenizers, scheduler).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .dispatch import dispatch
from .hardware import Hardware
from .inventory import Component, Inventory, inspect, live_component, read_model_index, resolve_dtype
from .plan import Plan
from .planner import budgets, plan_inventory, resolve_hardware, resolve_strategy
from .quiet import quiet_progress


def load(path, plan: Plan | None = None, strategy=None, hardware: Hardware | str | None = None, max_memory=None,
         dtype=None, variant: str | None = None, headroom=None, *, device_map=None, torch_dtype=None,
         progress: bool = True, check_transfers: bool = True, **kwargs):
    """Load a pipeline folder onto its plan and return the dispatched pipeline.

    Keyword arguments that name a component (``controlnet=...``) pass that component in already built: it is
    sized, placed and hooked like the rest. Other keyword arguments go to ``DiffusionPipeline.from_pretrained``.

    >>> pipe = pipemap.load("path/to/sdxl", device_map="balanced", max_memory={0: "20GiB", 1: "20GiB"},
    ...                     dtype=torch.float16, variant="fp16")                        # doctest: +SKIP
    >>> pipe.hf_device_map                                                              # doctest: +SKIP
    {'text_encoder': 'cuda:1', 'text_encoder_2': 'cuda:1', 'unet': 'cuda:0', 'vae': 'cuda:1'}
    """
    folder = Path(path)
    index = read_model_index(folder)
    dtype = resolve_dtype(dtype, torch_dtype)
    passed = {k: kwargs.pop(k) for k in list(kwargs) if k in index and not k.startswith("_")}
    if plan is None:
        inventory = with_passed(inspect(folder, dtype, variant), passed)
        hw = resolve_hardware(hardware, max_memory)
        plan = plan_inventory(inventory, hw, resolve_strategy(strategy, device_map), budgets(hw, headroom))
    dtype = dtype if dtype is not None else _plan_dtype(plan)
    variant = variant if variant is not None else plan.variant
    with quiet_progress():
        pipe = _load_onto(folder, index, plan, passed, dtype, variant, progress, kwargs)
    dispatch(pipe, plan, check_transfers=check_transfers)
    return pipe


def _load_onto(folder: Path, index: dict, plan: Plan, passed: dict, dtype, variant, progress: bool, kwargs: dict):
    """Each planned model loaded onto its device, then the pipeline assembled around them."""
    models = {}
    for placement in tqdm(plan.components, desc="pipemap: loading", unit="model", disable=not progress):
        if placement.component not in passed:
            library, class_name = index[placement.component]
            models[placement.component] = load_component(folder, placement.component, library, class_name,
                                                          _load_device(placement), dtype, variant)
    from diffusers import DiffusionPipeline  # here, not at import: it pulls in every pipeline class

    extra = {"dtype": dtype} if dtype is not None else {}
    return DiffusionPipeline.from_pretrained(folder, **models, **passed, variant=variant, **extra, **kwargs)


def load_component(folder: Path, name: str, library: str, class_name: str, device: str,
                   dtype: torch.dtype | None, variant: str | None) -> torch.nn.Module:
    """One model loaded by its library onto ``device`` (``device_map=device``), at ``dtype`` if given."""
    cls = getattr(importlib.import_module(library), class_name)
    options = {"subfolder": name}
    if device != "cpu":  # the CPU is where from_pretrained loads anyway; a device_map there only adds a dispatch
        options["device_map"] = device
    if dtype is not None:
        options["dtype"] = dtype
    if variant is not None and _has_variant(folder / name, variant):
        options["variant"] = variant
    return cls.from_pretrained(folder, **options)


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
    # part to its GPU, since loading it whole onto its first GPU is what it was split for not fitting
    return placement.device if placement.mode in ("resident", "replicated") else "cpu"  # copies made at dispatch


def _plan_dtype(plan: Plan) -> torch.dtype | None:
    return getattr(torch, plan.dtype) if plan.dtype else None


def _has_variant(subfolder: Path, variant: str) -> bool:
    return any(f".{variant}." in p.name or f".{variant}-" in p.name for p in subfolder.glob("*.safetensors"))
