"""Which denoisers strategy ``"parallel"`` can copy onto several GPUs, how the copies share the work, and what the
plan says about it: the planning half of the hooks that run the copies (``replicated``, ``guidance``, ``sequence``),
below the planner and free of hooks.

Three ways a second GPU speeds up one image, by what the pipeline's calls of its denoiser allow:

- ``replicated``: the pipeline runs both guidance branches as one batch (SD, SDXL, SD3): the batch is cut across the
  copies.
- ``guidance``: it calls the denoiser once per branch (Wan, Qwen-Image, Flux's true CFG): each step's second call runs
  on the copy while the first runs.
- ``sequence``: the denoiser's class carries diffusers' context-parallel plan (``_cp_plan``: Flux, Qwen-Image, Wan,
  LTX): each call's tokens are split across the copies, attention exchanging keys and values.
- ``guidance_sequence``: both of the last two, on 4 GPUs or more: each guidance branch's tokens split across half of
  the GPUs (vLLM-Omni's and xDiT's CFG parallel with Ulysses inside).

A copy for guidance branches is made only where the call makes a second denoiser call a step (true CFG: Wan's
default call, Qwen-Image's or Flux's with a negative prompt): for one call a step (guidance-distilled Flux.1-dev,
Qwen-Image without a negative prompt) the copy would compute a branch no call uses, so the tokens are split instead.
Where more than one applies, the cost model's seconds per image at the call planned for (the pipeline's default
call unless one is given) order them, each mode on as many GPUs as it can use.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from .cost import Workload, component_cost, workload_for
from .experts import EXPERTS
from .hardware import Performance
from .inventory.values import DENOISERS, Component, Inventory
from .modes import Mode, branch_devices
from .plan import Placement
from .units import format_bytes

MODES = (Mode.REPLICATED, Mode.GUIDANCE, Mode.SEQUENCE, Mode.GUIDANCE_SEQUENCE)
SEQUENCE_GPUS = (8, 4, 2)  # Ulysses gives each GPU a share of the heads: 24 (Flux, Qwen-Image), 40 (Wan) divide
# model classes whose context-parallel path in diffusers 0.42 does not give the plain outputs, and why
SEQUENCE_BROKEN = {
    "LTXVideoTransformer3DModel": "its attention mask keeps every head while Ulysses attention gives each GPU a "
                                  "share of them",
}

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


@functools.cache
def splits_sequence(class_name: str | None) -> bool:
    """Whether a diffusers model class carries a context-parallel plan (``_cp_plan``) to split its tokens by, and
    its context-parallel path gives the plain outputs (``SEQUENCE_BROKEN``)."""
    import diffusers

    cls = getattr(diffusers, class_name or "", None)
    return isinstance(cls, type) and bool(getattr(cls, "_cp_plan", None)) and class_name not in SEQUENCE_BROKEN


def parallel_modes(inventory: Inventory, perf: Performance | None = None, gpus: int = 2,
                   work: Workload | None = None) -> tuple[tuple[str, str], ...]:
    """``(denoiser, mode)`` for each way strategy ``"parallel"`` may use more of ``gpus`` GPUs for it, the fastest
    first by the cost model at the call ``work`` (the pipeline's default call unless given), each mode on as many of
    them as it can use (``copy_counts``); guidance branches only where that call makes two denoiser calls a step;
    nothing when there is no denoiser.

    >>> parallel_modes(pipemap.inspect("qwen-image"), gpus=4)                # doctest: +SKIP
    (('transformer', 'sequence'),)
    """
    denoiser = _denoiser(inventory)
    if denoiser is None:
        return ()
    component = next(c for c in inventory.models if c.name == denoiser)
    figures = perf or Performance()
    work = work or workload_for(inventory)
    counts = {m: copy_counts(m, gpus, component.heads) for m in _applicable(inventory, component, work)}
    modes = sorted((m for m, n in counts.items() if n), key=lambda m: _seconds(inventory, component, m, figures,
                                                                                 counts[m][0], work))
    return tuple((denoiser, m) for m in modes)


def copy_counts(mode: str, gpus: int, heads: int = 0) -> list[int]:
    """How many of ``gpus`` GPUs a mode may run the denoiser on, the most first: two for guidance branches, a
    power of two dividing the attention ``heads`` (unknown: 0) for a sequence split, twice that for both at once
    (each branch split across half of them), any number from two for a batch split."""
    count = _COUNTS.get(mode)
    return count(gpus, heads) if count is not None else list(range(gpus, 1, -1))


def _sequence_counts(gpus: int, heads: int, branches: int) -> list[int]:
    return [branches * n for n in SEQUENCE_GPUS if branches * n <= gpus and (not heads or heads % n == 0)]


_COUNTS: dict[str, Callable[[int, int], list[int]]] = {
    Mode.GUIDANCE: lambda gpus, heads: [2] if gpus >= 2 else [],
    Mode.SEQUENCE: lambda gpus, heads: _sequence_counts(gpus, heads, 1),
    Mode.GUIDANCE_SEQUENCE: lambda gpus, heads: _sequence_counts(gpus, heads, 2)}


def _applicable(inventory: Inventory, component: Component, work: Workload | None = None) -> list[str]:
    """The modes the pipeline's calls allow: guidance branches only where the call makes a second denoiser call a
    step (``work.guidance``; a copy would otherwise compute a branch no call uses)."""
    batched = batches_guidance(inventory.pipeline_class)
    branches = batched is False and (work is None or work.guidance)
    modes: list[str] = [Mode.REPLICATED] if batched else [Mode.GUIDANCE] if branches else []
    if splits_sequence(component.class_name):
        modes += [Mode.SEQUENCE, Mode.GUIDANCE_SEQUENCE] if branches else [Mode.SEQUENCE]
    return modes


def _seconds(inventory: Inventory, component: Component, mode: str, perf: Performance, gpus: int,
             work: Workload) -> float:
    dtype_bytes = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(inventory.dtype or "", 4)
    copies = Placement(component.name, "cuda:0", component.bytes, mode,
                       replicas=tuple(f"cuda:{i}" for i in range(1, gpus)))
    return component_cost(copies, component, dtype_bytes, perf, work).total


def _denoiser(inventory: Inventory) -> str | None:
    names = {c.name for c in inventory.models}
    return next((n for n in DENOISERS if n in names), None)


def denoiser_heads(inventory: Inventory) -> int:
    """The denoiser's attention heads (0: unknown, or no denoiser)."""
    denoiser = _denoiser(inventory)
    return next((c.heads for c in inventory.models if c.name == denoiser), 0)


def replicable(inventory: Inventory) -> tuple[str, ...]:
    """The denoiser, when its calls carry a batch that replicas can split; else nothing."""
    denoiser = _denoiser(inventory)
    return (denoiser,) if denoiser and batches_guidance(inventory.pipeline_class) else ()


def plan_notes(inventory: Inventory, placed: Mapping[str, Any], work: Workload | None = None) -> list[str]:
    """What strategy ``"parallel"`` did with the denoiser, which GPU runs what, and why when it made no copies, for
    the call ``work`` (the pipeline's default call unless given)."""
    denoiser = _denoiser(inventory)
    if denoiser is None:
        return ["parallel: no denoiser to replicate; placed as balanced"]
    place: Any = placed.get(denoiser)  # a device name or a planner.Place
    copies = getattr(place, "replicas", ())
    if copies:
        return [_what_runs_where(denoiser, place.mode, place.device, copies), *_second_expert(placed, denoiser)]
    return [_no_copies(inventory, denoiser, work or workload_for(inventory))]


def _second_expert(placed: Mapping[str, Any], denoiser: str) -> list[str]:
    """A line for a two-expert pipeline's second expert (``experts.EXPERTS``: Wan 2.2), copied as the first or not."""
    second = next((e for e in EXPERTS if e != denoiser and e in placed), None) if denoiser in EXPERTS else None
    if second is None:
        return []
    copies = getattr(placed[second], "replicas", ())
    if copies:
        return [f"parallel: {second}, the second expert (its own steps of each call), copied the same way"]
    return [f"parallel: {second}, the second expert, has no copies: no GPU holds both experts beside the rest"]


def call_note(inventory: Inventory, work: Workload | None = None) -> str:
    """The call strategy ``"parallel"`` chose for, as ``explain()`` says it (the pipeline's default call unless
    ``work`` is given), and why it made no guidance copy where that call makes one denoiser call a step."""
    work = work or workload_for(inventory)
    return f"parallel: chosen for the call {work.describe()}" + _one_call_why(inventory, work)


def _one_call_why(inventory: Inventory, work: Workload) -> str:
    if work.guidance or batches_guidance(inventory.pipeline_class) is not False:
        return ""
    return (": one denoiser call a step (guidance-distilled, or no negative prompt), so no copy for a second "
            "guidance branch that no call would use; a call with a negative prompt is planned with call=")


def _no_copies(inventory: Inventory, denoiser: str, work: Workload) -> str:
    component = next(c for c in inventory.models if c.name == denoiser)
    if _applicable(inventory, component, work) == ["sequence"] and component.heads % 2:
        why = (f"its {component.heads} attention heads do not divide among the GPUs (a sequence split gives each GPU "
               "a share of them)")
    elif _applicable(inventory, component, work):
        why = f"no two GPUs hold a copy of the {denoiser} ({format_bytes(component.bytes)}) beside the other components"
    elif _applicable(inventory, component):
        why = (f"the call makes one {denoiser} call a step, and {component.class_name} has no context-parallel plan "
               "to split its tokens by")
    else:
        why = (f"{inventory.pipeline_class} is not a diffusers pipeline class, so how it calls its {denoiser} is "
               f"unknown, and {component.class_name} has no context-parallel plan")
    return f"parallel: no replicas: {why}; placed as balanced"


def _what_runs_where(denoiser: str, mode: str, home: str, copies: tuple[str, ...]) -> str:
    return _RUNS_WHERE.get(mode, _batch_split)(denoiser, home, copies)


def _guidance_branches(denoiser: str, home: str, copies: tuple[str, ...]) -> str:
    return (f"parallel: {denoiser} guidance branches at once: {home} runs each step's first call (conditional), "
            f"{copies[0]} its second (unconditional), started from the inputs the first call brings with the "
            "step before's negative prompt, and used only when the second call's inputs are exactly those")


def _branches_split(denoiser: str, home: str, copies: tuple[str, ...]) -> str:
    first, second = branch_devices(home, copies)
    return (f"parallel: {denoiser} guidance branches at once, each split by its tokens: {', '.join(first)} run "
            f"each step's first call (conditional), {', '.join(second)} its second (unconditional), started from "
            "the inputs the first call brings with the step before's negative prompt and used only when the "
            "second call's inputs are exactly those; each half's attention exchanges within the half "
            "(diffusers' context-parallel plan, Ulysses attention)")


def _tokens_split(denoiser: str, home: str, copies: tuple[str, ...]) -> str:
    gpus = ", ".join((home, *copies))
    return (f"parallel: {denoiser} tokens split across {gpus}: each GPU computes its share of every call's "
            "tokens, attention exchanging queries, keys and values between them (diffusers' context-parallel "
            f"plan, Ulysses attention); {home} returns the output")


def _batch_split(denoiser: str, home: str, copies: tuple[str, ...]) -> str:
    gpus = ", ".join((home, *copies))
    return (f"parallel: {denoiser} replicated on {gpus}; each call's batch (guidance, images per prompt) is split "
            "across the copies")


_RUNS_WHERE: dict[str, Callable[[str, str, tuple[str, ...]], str]] = {
    Mode.GUIDANCE: _guidance_branches, Mode.GUIDANCE_SEQUENCE: _branches_split, Mode.SEQUENCE: _tokens_split}
