"""Pipelines with two denoising experts (Wan 2.2 A14B: ``transformer`` runs the high-noise steps, ``transformer_2``
the rest, switched at ``boundary_ratio`` of the scheduler's training timesteps): which expert runs how many of a
call's steps, as the pipeline decides it (``WanPipeline.__call__``: ``t >= boundary_ratio * num_train_timesteps``
runs ``transformer``). The cost model prices each expert at its own steps (``cost.predict``); a dry run of two steps
only ever sees the first expert, so its counts are split here too.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

EXPERTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class Boundary:
    """Where a two-expert pipeline switches: its ``boundary_ratio`` and the scheduler that sets the timesteps."""

    ratio: float
    scheduler: str  # the scheduler's class name (``model_index.json``)
    config: str  # its ``scheduler_config.json``, as JSON text (hashable, for the cache)


def boundary_of(source: object) -> Boundary | None:
    """The switch of a catalog name's or a folder's two experts; None for a pipeline without ``boundary_ratio``, or a
    source that is neither (a loaded pipeline's inventory)."""
    index, config = _published(source)
    ratio = index.get("boundary_ratio")
    scheduler = index.get("scheduler")
    if ratio is None or not isinstance(scheduler, list) or len(scheduler) != 2:
        return None
    return Boundary(float(ratio), str(scheduler[1]), json.dumps(config, sort_keys=True))


def _published(source: object) -> tuple[Mapping, Mapping]:
    """A source's ``model_index.json`` and scheduler config, from its folder or the catalog; empty if neither."""
    from . import catalog

    if isinstance(source, str) and os.path.isdir(source):
        return _read(os.path.join(source, "model_index.json")), _read(
            os.path.join(source, "scheduler", "scheduler_config.json"))
    if isinstance(source, str) and catalog.resolve(source) is not None:
        entry = catalog.entry(source)
        return entry.model_index, entry.scheduler_config
    return {}, {}


def _read(path: str) -> Mapping:
    try:
        with open(path) as file:
            found = json.load(file)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def first_expert_steps(boundary: Boundary | None, steps: int) -> int:
    """How many of ``steps`` denoising steps the first expert (``transformer``) runs: the scheduler's timesteps at or
    above the boundary; half of them when the switch is unknown.

    >>> first_expert_steps(None, 40)
    20
    """
    if boundary is None or steps <= 0:
        return max(0, steps) // 2
    return _first_steps(boundary, steps)


@functools.lru_cache(maxsize=64)
def _first_steps(boundary: Boundary, steps: int) -> int:
    import diffusers

    config = json.loads(boundary.config)
    scheduler_class = getattr(diffusers, boundary.scheduler, None)
    if scheduler_class is None:
        return steps // 2
    scheduler = scheduler_class.from_config(config)
    scheduler.set_timesteps(steps, device="cpu")
    threshold = boundary.ratio * config.get("num_train_timesteps", 1000)
    return int(sum(1 for t in scheduler.timesteps[:steps] if float(t) >= threshold))


def expert_steps(source: object, names: set[str] | frozenset[str], steps: int) -> dict[str, int] | None:
    """Each expert's steps of a call of ``steps`` denoising steps, for a pipeline that has both (``EXPERTS``); None
    otherwise."""
    if not set(EXPERTS) <= set(names):
        return None
    first = first_expert_steps(boundary_of(source), steps)
    return {EXPERTS[0]: first, EXPERTS[1]: steps - first}
