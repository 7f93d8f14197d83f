"""Facts about a checkpoint folder: its ``model_index.json``, the class and dtype each entry loads with (as
diffusers and transformers decide), the checks a folder must pass, and its components sized from their headers.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import NotAPipelineError, VariantNotFoundError
from ..granularity import finest_in_flight
from ..quantized import quantization_method
from .files import file_bytes, header_and_end, tensor_bytes, variant_of, weight_files
from .trees import attention_width, block_tree, split_blocks
from .values import Component, Inventory, dtype_name, heads_of

_WEIGHTED_LIBRARIES = ("diffusers", "transformers")  # their components are loaded from a subfolder


def read_model_index(folder: Path) -> dict[str, Any]:
    """The parsed ``model_index.json`` of a pipeline folder, or a NotAPipelineError that says what is wrong. A copy
    of what ``_parsed_index`` keeps by the file's stamp: ``load`` reads it twice (its own checks, the inventory),
    and a read cost as much as 20 stats right after a load (issue 38: load time); a file rewritten has a new stamp."""
    index = folder / "model_index.json"
    if not folder.is_dir():
        raise NotAPipelineError(str(folder), "no such folder")
    (stamp,) = _stamp([index])
    if stamp is None or not index.is_file():
        raise NotAPipelineError(str(folder), "it has no model_index.json")
    return {key: list(value) if isinstance(value, list) else value
            for key, value in _parsed_index(index, stamp).items()}


@functools.lru_cache(maxsize=64)
def _parsed_index(index: Path, stamp: tuple[int, int, int]) -> dict[str, Any]:
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise NotAPipelineError(str(index.parent), f"model_index.json is not valid JSON ({err})") from err
    if not isinstance(data, dict) or "_class_name" not in data:
        raise NotAPipelineError(str(index.parent), "model_index.json has no _class_name")
    return data


def of_folder(folder: Path, dtype: torch.dtype | None, variant: str | None) -> Inventory:
    """A folder's components, each weighted one sized from its files' headers at ``dtype`` (no weight read)."""
    index = read_model_index(folder)
    check_variant(folder, index, variant)
    components = []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        library, class_name = entry
        if not (folder / name).is_dir() and not loaded_from_folder(index["_class_name"], name):
            components.append(Component(name, library, class_name))  # the pipeline makes it (LongCat's scheduler)
            continue
        check_entry(folder, name, library, class_name)
        files = weight_files(folder / name, variant) if library is not None else []
        if not files:
            components.append(Component(name, library, class_name))
            continue
        stamp = _stamp([*files, folder / name / "config.json"])
        components.append(_weighted_component(folder, name, library, class_name, dtype, tuple(files), stamp))
    return Inventory(str(folder), index["_class_name"], tuple(components), dtype_name(dtype), variant)


Stamp = tuple[tuple[int, int, int] | None, ...]  # per file: inode, size, modification time (None: no such file)


def _stamp(paths: list[Path]) -> Stamp:
    """What says a file is unchanged without reading it: its inode, size and modification time."""
    found: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            found.append(None)
            continue
        found.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(found)


@functools.lru_cache(maxsize=64)
def _weighted_component(folder: Path, name: str, library: str, class_name: str, dtype: torch.dtype | None,
                        files: tuple[Path, ...], stamp: Stamp) -> Component:
    """A weighted component sized from its files' headers. Cached by the files' ``stamp`` (issue 28): loading the
    same folder again (``pipemap.load`` sizes it before loading, every time) reads and sizes no header twice, while
    a file rewritten in place has a new stamp and is read afresh."""
    at = dtype if dtype is not None else default_dtype(folder / name, library)
    keep = keep_in_fp32(library, class_name, at)
    quantized = quantization_method(_config(folder / name)) is not None
    read = [header_and_end(f) for f in files]  # each file's end too: ``load``'s check reads no header again
    headers = {key: meta for header, _ in read for key, meta in header.items()}
    sizes = {key: tensor_bytes(meta, key, at, keep, quantized) for key, meta in headers.items()}
    tree = block_tree(sizes)
    mappable = library in _WEIGHTED_LIBRARIES and all(sizes[k] == file_bytes(m) for k, m in headers.items())
    return Component(name, library, class_name, sum(sizes.values()), True, in_flight=finest_in_flight(tree),
                     blocks=split_blocks(sizes), tree=tree, attention_width=attention_width(sizes, at.itemsize),
                     files=tuple(f"{name}/{f.name}" for f in files) if mappable else (),
                     heads=heads_of(_config(folder / name)),
                     ends=tuple((f"{name}/{f.name}", end) for f, (_, end) in zip(files, read, strict=True)))


def check_entry(folder: Path, name: str, library: object, class_name: object) -> None:
    """A ``model_index.json`` entry that names a library pipemap can import and a subfolder that exists."""
    if library is None and class_name is None:
        return  # an optional component left out (a safety checker), as diffusers writes it
    if not isinstance(library, str) or not isinstance(class_name, str):
        raise NotAPipelineError(str(folder), f"model_index.json entry {name!r} is {[library, class_name]!r}, "
                                "not [library, class name]")
    if importlib.util.find_spec(library.split(".")[0]) is None and not _pipeline_module(folder / name, library):
        raise NotAPipelineError(str(folder), f"component {name!r} names the library {library!r}, which is not "
                                "installed; install it, or fix model_index.json")
    if not (folder / name).is_dir() and library in _WEIGHTED_LIBRARIES:
        raise NotAPipelineError(str(folder), f"component {name!r} has no subfolder {name}/; restore it from the "
                                "pipeline's repository, or set its entry to [null, null] if the pipeline allows")
    if library in _WEIGHTED_LIBRARIES and not _resolves(library, class_name):
        raise NotAPipelineError(str(folder), f"component {name!r} names the class {class_name!r}, which the "
                                f"installed {library} does not have; fix model_index.json, or install the {library} "
                                "version the pipeline was saved with")


@functools.lru_cache(maxsize=256)
def _resolves(library: str, class_name: str) -> bool:
    """Whether diffusers' own resolution finds the class (renamed transformers classes included); asked once per
    (library, class) in a process: the installed libraries do not change under it (each load asked again: 20 ms)."""
    try:
        return component_class(library, class_name) is not None
    except (ImportError, AttributeError, ValueError):
        return False


def loaded_from_folder(pipeline_class: str, name: str) -> bool:
    """Whether ``DiffusionPipeline.from_pretrained`` loads the entry ``name`` from its subfolder: the pipeline's
    ``__init__`` takes it without a default, or lists it in ``_optional_components``. Another entry (LongCat
    AudioDiT's ``scheduler=None``, which the pipeline makes itself) is neither saved nor loaded. An unknown class:
    assume it is loaded."""
    import diffusers

    cls = getattr(diffusers, pipeline_class, None) if isinstance(pipeline_class, str) else None
    if not isinstance(cls, type) or not hasattr(cls, "_get_signature_keys"):
        return True
    return name in _loaded_keys(cls)


@functools.lru_cache(maxsize=256)
def _loaded_keys(cls: Any) -> frozenset[str]:
    """The components a pipeline class's ``__init__`` takes (diffusers reads its signature): asked of every entry
    at every load."""
    expected, _ = cls._get_signature_keys(cls)
    return frozenset(expected)


def _pipeline_module(folder: Path, library: str) -> bool:
    """A library name diffusers resolves without importing it: one of its pipeline modules (DeepFloyd IF's
    ``deepfloyd_if``) or a custom module in the component's own folder."""
    if (folder / f"{library}.py").is_file():
        return True
    from diffusers import pipelines

    return hasattr(pipelines, library)


def check_variant(folder: Path, index: Mapping[str, Any], variant: str | None) -> None:
    """A ``variant`` that at least one component has files of (diffusers falls back per component, but a variant
    none has is a typo that would silently load the plain weights)."""
    if variant is None:
        return
    found: set[str] = set()
    for name in index:
        if not name.startswith("_") and (folder / name).is_dir():
            found |= {v for v in map(variant_of, (folder / name).iterdir()) if v}
    if variant not in found:
        raise VariantNotFoundError(str(folder), variant, tuple(sorted(found)))


def _config(subfolder: Path) -> dict[str, Any]:
    """A component's ``config.json``, or an empty dict when it has none (or an unreadable one)."""
    try:
        config = json.loads((subfolder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def default_dtype(subfolder: Path, library: str) -> torch.dtype:
    """The dtype a component loads in when none is asked for: diffusers models load as float32, transformers
    models in the dtype their config.json names (so a folder saved in fp16 loads its text encoders in fp16)."""
    if library != "transformers":
        return torch.float32
    try:
        config = json.loads((subfolder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return torch.float32
    name = config.get("dtype") or config.get("torch_dtype")
    candidate = getattr(torch, str(name), None) if name else None
    return candidate if isinstance(candidate, torch.dtype) else torch.float32


def component_class(library: str, class_name: str, folder: Path | None = None, name: str | None = None,
                    trust_remote_code: bool = False) -> type[Any]:
    """The class ``DiffusionPipeline.from_pretrained`` loads a ``model_index.json`` entry with.

    diffusers' own resolution, so that every library name it accepts works here too: a diffusers pipeline module
    (DeepFloyd IF's ``["deepfloyd_if", "IFWatermarker"]``, Shap-E's ``["shap_e", "ShapERenderer"]``), a custom
    class in the component's folder, renamed transformers classes; importing the library name would miss them.
    """
    from diffusers import pipelines
    from diffusers.pipelines.pipeline_loading_utils import ALL_IMPORTABLE_CLASSES, get_class_obj_and_candidates

    cls, _ = get_class_obj_and_candidates(library, class_name, ALL_IMPORTABLE_CLASSES, pipelines,
                                          hasattr(pipelines, library), component_name=name,
                                          cache_dir=None if folder is None else str(folder),
                                          trust_remote_code=trust_remote_code)
    return cast("type[Any]", cls)


def keep_in_fp32(library: str, class_name: str, dtype: torch.dtype | None) -> tuple[str, ...]:
    """The module names the model class keeps in float32 at ``dtype``, as its library's loader decides."""
    if dtype is None or dtype == torch.float32:
        return ()
    try:
        cls = component_class(library, class_name)
    except (ImportError, AttributeError, ValueError):
        return ()
    keep = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or []) if dtype in (
        torch.float16, torch.bfloat16) else []
    if library == "diffusers" or dtype == torch.float16:  # transformers upcasts the plain list for fp16 only
        keep += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    return tuple(keep)


@dataclass(frozen=True)
class ModelEntry:
    """How ``from_pretrained`` builds one model entry of a folder: the class, the library whose loader builds it (a
    pipeline module's model, Shap-E's renderer or DeepFloyd IF's watermarker, is a diffusers or a transformers
    model), the dtype it loads in and the modules its class keeps in float32 there."""

    cls: type[Any]
    library: str
    dtype: torch.dtype
    keep_fp32: tuple[str, ...]


def model_entry(folder: Path, name: str, library: str, class_name: str, dtype: torch.dtype | None
                ) -> ModelEntry | None:
    """How the entry ``name`` of ``folder`` loads at ``dtype`` (None: each as its loader defaults), as the dry run
    builds it; None for an entry without weights (a tokenizer, scheduler or processor) or a class not found. The one
    question the stand-in builder asks of a folder's entry: the answer is whole, so nothing here calls back."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    try:
        cls = component_class(library, class_name, folder, name)
    except (ImportError, AttributeError, ValueError):
        return None
    if isinstance(cls, type) and issubclass(cls, ModelMixin):
        loader = "diffusers"
    elif isinstance(cls, type) and issubclass(cls, PreTrainedModel):
        loader = "transformers"
    else:
        return None
    at = dtype if dtype is not None else default_dtype(folder / name, loader)
    return ModelEntry(cls, loader, at, keep_in_fp32(loader, class_name, at))
