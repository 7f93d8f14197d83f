"""Which denoisers strategy ``"parallel"`` can copy onto several GPUs, and what the plan says about it: the planning
half of ``parallel`` (whose other half runs the copies), below the planner and free of hooks.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import re
from collections.abc import Mapping
from typing import Any

from .inventory import DENOISERS, Inventory
from .units import format_bytes

# `torch.cat([latents] * 2)` or `torch.cat([x, x])`: the pipeline runs both guidance branches as one batch
_GUIDANCE_BATCH = re.compile(r"torch\.cat\(\s*\[\s*\w+\s*\]\s*\*\s*2\s*\)|torch\.cat\(\s*\[\s*(\w+)\s*,\s*\1\s*\]")


@functools.cache
def batches_guidance(pipeline_class: str) -> bool | None:
    """Whether a diffusers pipeline class runs classifier-free guidance as one concatenated batch (True: SD, SDXL,
    SD3, ControlNet, PixArt, ...) or calls its denoiser once per branch (False: Flux's true CFG, Wan, Qwen-Image);
    None when the class is not diffusers' (nothing to read). Read from the class's ``__call__`` source, as no
    attribute says it."""
    import diffusers

    cls = getattr(diffusers, pipeline_class, None)
    try:
        source = pyinspect.getsource(cls.__call__) if isinstance(cls, type) else None
    except (OSError, TypeError):
        source = None
    return None if source is None else bool(_GUIDANCE_BATCH.search(source))


def _denoiser(inventory: Inventory) -> str | None:
    names = {c.name for c in inventory.models}
    return next((n for n in DENOISERS if n in names), None)


def replicable(inventory: Inventory) -> tuple[str, ...]:
    """The denoiser, when its calls carry a batch that replicas can split; else nothing."""
    denoiser = _denoiser(inventory)
    return (denoiser,) if denoiser and batches_guidance(inventory.pipeline_class) else ()


def plan_notes(inventory: Inventory, placed: Mapping[str, Any]) -> list[str]:
    """What strategy ``"parallel"`` did with the denoiser, and why when it made no replicas."""
    denoiser = _denoiser(inventory)
    if denoiser is None:
        return ["parallel: no denoiser to replicate; placed as balanced"]
    place: Any = placed.get(denoiser)  # a device name or a planner.Place
    if getattr(place, "replicas", ()):
        return [f"parallel: {denoiser} replicated on {', '.join((place.device, *place.replicas))}; each call's batch "
                "(guidance, images per prompt) is split across the copies"]
    kind, cls = batches_guidance(inventory.pipeline_class), inventory.pipeline_class
    size = next(c.bytes for c in inventory.models if c.name == denoiser)
    why = {None: f"{cls} is not a diffusers pipeline class, so whether its {denoiser} calls carry a batch is unknown",
           False: f"{cls} calls its {denoiser} once per guidance branch (no concatenated batch to split)",
           True: f"no two GPUs hold a copy of the {denoiser} ({format_bytes(size)}) beside the other components"}
    return [f"parallel: no replicas: {why[kind]}; placed as balanced"]
