"""Counts by call shape, kept: a pipeline's counted work (``counter``) is the same for every call of the same shape
on the same configs, so a dry run counts it once and the cost model prices it ever after.

Kept in memory, and on disk (``$PIPEMAP_CACHE_DIR/counts``, else under huggingface_hub's home) keyed by a hash of
the pipeline's configs, the dtype, the call's shape and the library versions; the catalog's published pipelines
carry theirs at the default call in ``catalog/counts.record`` (``write_catalog_counts``; a test checks it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import diffusers
import torch
import transformers

from .. import catalog
from ..counts import Counts, shape_of
from ..hardware import Hardware
from ..inventory import inventory_of
from ..inventory.values import Inventory
from ..plan import Plan
from ..planner import budgets, plan_inventory
from ..runtime.transfer import cache_path
from .run import count_work

# bumped when the counter's rules change: older cached counts are not read (2: attention counted apart, boolean
# masks as the fused kernels run them)
COUNTER_VERSION = 2
RECORD_DEPTH = 3  # the catalog's record keeps each component's work by module down to paths of 3 parts
_KEPT: dict[str, Counts] = {}


def known_counts(source, dtype: str | None, call: Mapping | None = None) -> Counts | None:
    """The counts of ``source``'s call if known without a dry run (this process, the disk, the catalog's record);
    None otherwise. ``source``: a catalog name, a pipeline folder or a loaded pipeline."""
    call = dict(call or {})
    key = counts_key(source, dtype, call)
    if key is None:
        return None
    found = _KEPT.get(key) or _recorded(source, dtype, call) or _read(key)
    if found is None:
        return None
    _KEPT[key] = found
    return _at_steps(found, call)


def counts_for(source, dtype: str | None, call: Mapping | None = None, steps: int = 2) -> Counts | None:
    """The counts of ``source``'s call: known ones (``known_counts``), else a dry run of ``steps`` steps counts them
    (and they are kept). None for a source no dry run can run (an ``Inventory``)."""
    call = dict(call or {})
    known = known_counts(source, dtype, call)
    key = counts_key(source, dtype, call)
    if known is not None or key is None:
        return known
    counted = count_work(source, counting_plan(source, dtype), steps=steps, **call)
    _KEPT[key] = counted
    _write(key, counted)
    return counted


def counting_plan(source, dtype: str | None) -> Plan:
    """Every component resident on one stand-in GPU: what a component computes does not depend on where it is."""
    inventory = _inventory(source, dtype)
    hardware = Hardware.parse("cuda:0=1000TiB,cpu=1000TiB")
    return plan_inventory(inventory, hardware, "balanced", budgets(hardware, 0.0))


def _inventory(source, dtype: str | None) -> Inventory:
    if isinstance(source, str) and not os.path.exists(source) and catalog.resolve(source) is not None:
        return catalog.inventory(source, dtype)
    return inventory_of(source, dtype)


def _at_steps(counts: Counts, call: Mapping) -> Counts:
    steps = call.get("num_inference_steps")
    return counts if steps is None else replace(counts, steps=int(steps))


# ---- keys -------------------------------------------------------------------------------------------------------


def counts_key(source, dtype: str | None, call: Mapping) -> str | None:
    """A hash of what sets a call's work: the pipeline's configs, the dtype, the call's shape, the counter's and the
    libraries' versions. None for a source without configs to run (an ``Inventory``)."""
    configs = _configs(source)
    if configs is None:
        return None
    text = json.dumps([configs, str(dtype), shape_of(call), COUNTER_VERSION, torch.__version__,
                       diffusers.__version__, transformers.__version__], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _configs(source) -> object | None:
    if isinstance(source, Inventory):
        return None
    if isinstance(source, str) and not os.path.exists(source) and catalog.resolve(source) is not None:
        found = catalog.entry(source)
        return [found.model_index, found.configs, found.scheduler_config]
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.glob("**/*.json"))
                if p.name in ("model_index.json", "config.json", "scheduler_config.json")}
    if hasattr(source, "components"):
        return {name: [type(value).__name__, _config_of(value)] for name, value in source.components.items()}
    return None


def _config_of(value) -> object:
    config = getattr(value, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return dict(config) if isinstance(config, Mapping) else None


# ---- the catalog's record and the disk -------------------------------------------------------------------------


def _recorded(source, dtype: str | None, call: Mapping) -> Counts | None:
    name = catalog.resolve(source) if isinstance(source, str) and not os.path.exists(source) else None
    if name is None:
        return None
    found = catalog.recorded_counts(name)
    if found is None or shape_of(call) != found.shape or (dtype is not None and dtype != found.dtype):
        return None
    return found


def write_catalog_counts(names: list[str] | None = None) -> None:
    """Count every catalog pipeline's default call at its published dtype (a dry run each: minutes in all) and
    record them for ``auto`` and ``estimate`` on catalog names."""
    recorded = {name: counts.coarse(RECORD_DEPTH).to_dict() for name in catalog.names()
                if (counts := catalog.recorded_counts(name)) is not None}
    for name in names or catalog.names():
        dtype = catalog.entry(name).dtype
        counts = count_work(name, counting_plan(name, dtype))
        recorded[name] = counts.coarse(RECORD_DEPTH).to_dict()
    catalog.write_counts(recorded)


def _folder() -> Path:
    return cache_path().parent / "counts"


def _read(key: str) -> Counts | None:
    try:
        return Counts.from_dict(json.loads((_folder() / f"{key}.json").read_text()), origin="cached")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(key: str, counts: Counts) -> None:
    try:
        _folder().mkdir(parents=True, exist_ok=True)
        (_folder() / f"{key}.json").write_text(json.dumps(counts.to_dict()))
    except OSError:  # a read-only home: the counts stay in this process
        pass


def clear_counts(disk: bool = False) -> None:
    """Forget the counts kept in this process (and on disk too with ``disk=True``)."""
    _KEPT.clear()
    if disk:
        for path in _folder().glob("*.json"):
            path.unlink(missing_ok=True)
