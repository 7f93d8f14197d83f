"""Published pipelines pipemap can plan for without downloading a byte of weights.

Each ``*.json`` file beside this module holds one pipeline as its Hugging Face repository publishes it: the
``model_index.json`` (pipeline class, each component's library and class) and every model component's
``config.json``. Sizes come from building the real diffusers and transformers classes on the meta device (shapes
only, no memory) and counting their tensors at the target dtype, exactly as ``inspect`` counts a loaded pipeline.

>>> from pipemap import catalog
>>> catalog.resolve("black-forest-labs/FLUX.1-dev")
'flux.1-dev'
>>> inv = catalog.inventory("flux.1-dev")                      # doctest: +SKIP
>>> {c.name: c.bytes for c in inv.models}                       # doctest: +SKIP
{'text_encoder': 246120960, 'text_encoder_2': 9524621312, 'transformer': 23802816640, 'vae': 167639366}
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..counts import Counts
from ..errors import NotAPipelineError
from ..quiet import PATCHING, quiet_diffusers
from ..units import format_bytes

if TYPE_CHECKING:
    import torch

    from ..inventory.values import Inventory

# torch, diffusers and the inventory are imported inside the functions that build models: listing the catalog
# (`pipemap catalog`) reads only the JSON files here, so it answers without importing torch
_FOLDER = Path(__file__).parent
# each pipeline's model bytes at its published dtype, as `inventory` computes them (JSON; not *.json, which are entries)
_SIZES = _FOLDER / "sizes.record"
# each pipeline's default call counted by a dry run (``counts.Counts``), for the cost model (JSON)
_COUNTS = _FOLDER / "counts.record"


@dataclass(frozen=True)
class Entry:
    """One published pipeline: where it lives, what it is called, the dtype it is published to run in."""

    name: str
    repo: str
    aliases: tuple[str, ...]
    description: str
    dtype: str
    component_dtypes: dict
    model_index: dict
    configs: dict
    scheduler_config: dict = field(default_factory=dict)  # the published scheduler_config.json, for the dry run
    tokenizer_max_length: dict = field(default_factory=dict)  # each tokenizer's model_max_length, for the dry run
    family: str = ""  # what `pipemap catalog` groups it under: the model line it belongs to ("FLUX.1", "Wan")

    @property
    def pipeline_class(self) -> str:
        return self.model_index["_class_name"]

    def components(self) -> list[tuple[str, str | None, str | None]]:
        """``(name, library, class_name)`` in pipeline order, as ``model_index.json`` lists them."""
        return [(name, *value) for name, value in self.model_index.items()
                if not name.startswith("_") and isinstance(value, list) and len(value) == 2]


@functools.cache
def entries() -> dict[str, Entry]:
    entries = {}
    for path in sorted(_FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        entries[data["name"]] = Entry(data["name"], data["repo"], tuple(data.get("aliases", ())),
                                      data.get("description", ""), data["dtype"], data.get("component_dtypes", {}),
                                      data["model_index"], data["configs"], data.get("scheduler_config", {}),
                                      data.get("tokenizer_max_length", {}), data.get("family", ""))
    return entries


@functools.cache
def _lookup() -> dict[str, str]:
    table = {}
    for entry in entries().values():
        for key in (entry.name, entry.repo, *entry.aliases):
            table[key.lower()] = entry.name
    return table


def names() -> list[str]:
    """The catalog's pipeline names, sorted.

    >>> "flux.1-dev" in names()
    True
    """
    return sorted(entries())


def resolve(name: str) -> str | None:
    """The catalog name for ``name`` (a name, an alias or a Hub repo id, any case), or None if it is none of them.

    >>> resolve("SDXL"), resolve("Qwen/Qwen-Image"), resolve("no-such-model")
    ('stable-diffusion-xl-base-1.0', 'qwen-image', None)
    """
    return _lookup().get(str(name).strip().lower())


def nearest(name: str, count: int = 3) -> list[str]:
    """The catalog names closest to ``name`` (spelled as any of their names, aliases or repo ids), best first.

    >>> nearest("flux-schnell")[0]
    'flux.1-schnell'
    """
    table = _lookup()
    text = str(name).strip().lower()
    close = difflib.get_close_matches(text, list(table), n=4 * count, cutoff=0.5)
    inside = [key for key in table if len(text) >= 3 and (text in key or key in text)]  # "flux" in "flux.1-dev"
    return list(dict.fromkeys(table[key] for key in close + inside))[:count]


def unknown(name: str, reason: str = "no such folder, and no catalog name") -> NotAPipelineError:
    """The error for a source that is neither a folder nor a catalog name: the nearest names and where to look."""
    near = nearest(name)
    hint = f"the nearest catalog names: {', '.join(near)}; " if near else ""
    return NotAPipelineError(str(name), f"{reason} ({hint}`pipemap catalog` lists them all)")


def entry(name: str) -> Entry:
    """The catalog entry for ``name``; a NotAPipelineError that names the nearest ones if there is none."""
    resolved = resolve(name)
    if resolved is None:
        raise unknown(name, "it is neither a folder nor a catalog name")
    return entries()[resolved]


# ---- building skeletons --------------------------------------------------------------------------------------------


@functools.cache
def _skeleton(name: str, component: str) -> torch.nn.Module:
    """The component's real class built from its published config on the meta device: shapes, no memory.

    Cached: a T5-XXL or Qwen2.5-VL skeleton takes a second or two to build.
    """
    from accelerate import init_empty_weights
    from transformers import PreTrainedModel


    found = entries()[name]
    library, class_name = found.model_index[component]
    cls, config = model_class(library, class_name), found.configs[component]
    # published configs carry keys the class no longer takes (Qwen-Image's "pooled_projection_dim"): diffusers
    # ignores them, as it does on from_pretrained, but warns; the catalog stores them verbatim, so hush that
    with PATCHING, init_empty_weights(include_buffers=True), quiet_diffusers():
        if issubclass(cls, PreTrainedModel):
            return cls._from_config(transformers_config(config))
        return cls.from_config(config)


def model_class(library: str, class_name: str) -> type[Any]:
    # model_index names pipeline-local modules by pipeline folder ("stable_diffusion" for the safety checker),
    # as diffusers' loader resolves them
    module = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
    return getattr(importlib.import_module(module), class_name)


def transformers_config(config: dict):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **fields)


def component_dtype(found: Entry, component: str, dtype: torch.dtype | None) -> torch.dtype:
    from ..inventory.values import as_dtype

    if dtype is not None:
        return dtype
    return as_dtype(found.component_dtypes.get(component, found.dtype))


# ---- the public sizes ------------------------------------------------------------------------------------------


def inventory(name: str, dtype: torch.dtype | str | None = None) -> Inventory:
    """The pipeline's components sized at ``dtype`` (default: the dtype it is published to run in).

    A ``dtype`` applies to every model, as ``from_pretrained(torch_dtype=...)`` does; modules the class keeps in
    float32 stay float32. Without one, each model takes the published dtype (Wan's VAE: float32, the rest bf16).

    >>> inv = inventory("flux-dev", dtype=torch.float16)             # doctest: +SKIP
    >>> plan = pipemap.plan(inv, hardware="2x40GiB,cpu=64GiB")        # doctest: +SKIP
    """
    from ..inventory.values import as_dtype

    return _inventory(entry(name).name, as_dtype(dtype))


@functools.cache
def _inventory(name: str, dtype: torch.dtype | None) -> Inventory:
    from ..inventory.live import live_component
    from ..inventory.values import Component, Inventory, as_dtype

    found = entries()[name]
    components = []
    for component, library, class_name in found.components():
        if component not in found.configs:
            components.append(Component(component, library, class_name))
            continue
        at = component_dtype(found, component, dtype)
        sized = live_component(component, _skeleton(name, component), at, library, class_name)
        published = component_dtype(found, component, None)
        # weights published at the dtype asked for load as views of their files' maps (``Component.files``)
        components.append(replace(sized, files=(f"{component}/*.safetensors",) if at == published else ()))
    label = str(dtype if dtype is not None else as_dtype(found.dtype)).removeprefix("torch.")
    return Inventory(found.repo, found.pipeline_class, tuple(components), label, None)


def parameter_count(name: str) -> dict[str, int]:
    """Parameters of each model component (shared tensors once), in pipeline order.

    >>> parameter_count("sd1.5")["unet"]                             # doctest: +SKIP
    859520964
    """
    found = entry(name)
    return {component: sum(p.numel() for p in _skeleton(found.name, component).parameters())
            for component, _, _ in found.components() if component in found.configs}


def recorded_sizes() -> dict[str, dict[str, int]]:
    """``{pipeline: {model: bytes}}`` at each pipeline's published dtype, as recorded in ``sizes.record`` (a test
    checks the record against ``inventory``; ``write_sizes()`` refreshes it)."""
    try:
        return json.loads(_SIZES.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_sizes() -> None:
    """Record every pipeline's model bytes at its published dtype, for ``pipemap catalog`` to list at once."""
    sizes = {name: {c.name: c.bytes for c in inventory(name).models} for name in names()}
    _SIZES.write_text(json.dumps(sizes, indent=1) + "\n")


def recorded_counts(name: str) -> Counts | None:
    """The counted work of the pipeline's default call at its published dtype (``counts.Counts``), as recorded in
    ``counts.record`` (``dryrun.counted.write_catalog_counts`` refreshes it; a test checks it); None if absent."""
    return _recorded_counts().get(name)


@functools.cache
def _recorded_counts() -> dict[str, Counts]:
    try:
        data = json.loads(_COUNTS.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {name: Counts.from_dict(value, origin="recorded") for name, value in data.items()}


def write_counts(recorded: dict) -> None:
    """Write ``{pipeline: Counts.to_dict()}`` to ``counts.record``."""
    _COUNTS.write_text(json.dumps(recorded, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    _recorded_counts.cache_clear()


def families() -> dict[str, list[str]]:
    """The catalog's names by family, families in the order of their first name, names sorted.

    >>> families()["FLUX.1"][:2]
    ['chroma1-hd', 'flux.1-dev']
    """
    grouped: dict[str, list[str]] = {}
    for name in names():
        grouped.setdefault(entries()[name].family or "other", []).append(name)
    return dict(sorted(grouped.items(), key=lambda item: item[0].lower()))


def run_catalog() -> int:
    """Print the catalog as a table (``pipemap catalog``), grouped by family: each pipeline, the short names
    ``pipemap plan`` takes, its models' sizes at the published dtype, and the total. Returns the exit code."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"pipemap catalog: {len(names())} pipelines; `pipemap plan NAME` plans any of these by name, "
                  "`pipemap simulate NAME` dry-runs it; nothing is downloaded")
    table.add_column("pipeline (names `plan` takes)")
    table.add_column("component", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    recorded = recorded_sizes()
    for family, members in families().items():
        table.add_row(Text(f"{family} ({len(members)})", "bold magenta"), "", "", end_section=True)
        for name in members:
            sizes = recorded.get(name) or {c.name: c.bytes for c in inventory(name).models}
            _catalog_rows(table, entries()[name], sizes)
    Console().print(table)
    return 0


def _catalog_rows(table, found: Entry, sizes: dict[str, int]) -> None:
    from rich.text import Text

    dtypes = ", ".join([found.dtype] + [f"{c} {d}" for c, d in found.component_dtypes.items()])
    short = ", ".join(a for a in found.aliases if a != found.name and "/" not in a)
    about = [Text(found.name, "bold"), Text(f"names: {short}"), Text(found.repo, "dim"),
             Text(f"{found.pipeline_class}, {dtypes}", "dim")]
    for i, (component, size) in enumerate(sizes.items()):
        table.add_row(about[i] if i < len(about) else "", Text(component), format_bytes(size))
    rest = Text("\n").join(about[len(sizes):])
    table.add_row(rest, Text("total", "bold"), Text(format_bytes(sum(sizes.values())), "bold"), end_section=True)
