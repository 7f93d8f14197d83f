"""What a pipeline is made of, and how many bytes each component will take on its device.

From a folder nothing but ``model_index.json`` and the safetensors headers is read; from a loaded pipeline the
sizes come from its modules. Either way the bytes are those of the dtype the component will have once loaded.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import re
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, overload

import torch

from .errors import (
    ArgumentConflictError,
    ArgumentTypeError,
    CheckpointError,
    NotAPipelineError,
    UnknownDtypeError,
    VariantNotFoundError,
)
from .granularity import Block, finest_in_flight
from .quantized import is_packed, quantization_method, quantization_state, stored_bytes
from .ram import address, file_maps
from .units import aligned

# safetensors dtype codes -> bytes per element
_ELEMENT_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_FLOATING = {"F64", "F32", "F16", "BF16"}
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_MAX_HEADER = 100 * 1024 * 1024
_WEIGHTED_LIBRARIES = ("diffusers", "transformers")  # their components are loaded from a subfolder
# Nominal calls per image of a denoiser: 50 steps, twice each under classifier-free guidance. Every other model (text
# encoders, VAE, image encoders) runs once per image; back-to-back calls (a prompt and its negative) need one onload.
DENOISER_CALLS = 100
# the components that run at every step; the first of them present is the pipeline's execution device
DENOISERS = ("transformer", "unet", "prior", "decoder", "transformer_2")
PER_STEP = (*DENOISERS, "controlnet")
# Modules whose children are the blocks a streamed component is moved by: a list's own hook never fires.
_LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@dataclass(frozen=True)
class Component:
    """One entry of a pipeline: a model with weights (``bytes`` > 0) or a weightless part (tokenizer, scheduler)."""

    name: str
    library: str | None
    class_name: str | None
    bytes: int = 0
    has_weights: bool = False
    calls_per_image: int = 0  # 0: from the profile by name (``profile_calls``)
    in_flight: int = 0  # GPU bytes while it runs streamed (``streams.stream_charge``); 0: unknown
    # the repeated blocks a split may cut between, in order: ((module path, bytes), ...); the rest stays whole
    blocks: tuple[tuple[str, int], ...] = ()
    # its modules as a tree (``Block``): what streaming may move as one piece, down to leaf modules; None: unknown
    tree: Block | None = field(default=None, repr=False)
    # weight width summed over its self-attention layers (a transformer's): the cost model's attention FLOPs
    attention_width: int = 0
    # the safetensors files its weights can stay in, memory-mapped (paths below the pipeline folder; absolute for a
    # loaded pipeline's maps): only when every tensor is stored at the dtype it will have, so loading maps it and
    # converts nothing. Empty: its host copy must be RAM (``tiers``)
    files: tuple[str, ...] = ()
    # a transformer's attention heads (its config's ``num_attention_heads``; 0: unknown): a sequence split gives
    # each GPU a share of them, so it is planned only on GPU counts that divide them
    heads: int = 0

    def __post_init__(self) -> None:
        if not self.calls_per_image:
            object.__setattr__(self, "calls_per_image", profile_calls(self.name))


def profile_calls(name: str) -> int:
    """Nominal calls per image of a component named ``name``: a denoiser every step, anything else once."""
    return DENOISER_CALLS if name in PER_STEP else 1


@dataclass(frozen=True)
class Inventory:
    """A pipeline's components, sized at the dtype they will be loaded in.

    >>> inv = inventory_of("path/to/sdxl")                     # doctest: +SKIP
    >>> {c.name: c.bytes for c in inv.models}             # doctest: +SKIP
    {'text_encoder': 492265168, 'text_encoder_2': 2778702264, 'unet': 10270077736, 'vae': 334643268}
    """

    source: str
    pipeline_class: str
    components: tuple[Component, ...]
    dtype: str | None = None
    variant: str | None = None

    @property
    def models(self) -> tuple[Component, ...]:
        """The components that have weights, in pipeline order."""
        return tuple(c for c in self.components if c.has_weights)

    def __contains__(self, name: object) -> bool:
        return any(c.name == name for c in self.components)

    def __getitem__(self, name: str) -> Component:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(name)


def resolve_dtype(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The one dtype asked for: ``dtype`` (diffusers 0.42, transformers 5) or its older name ``torch_dtype``."""
    dtype, torch_dtype = as_dtype(dtype), as_dtype(torch_dtype)
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ArgumentConflictError("dtype", dtype, "torch_dtype", torch_dtype)
    return dtype if dtype is not None else torch_dtype


def inventory_of(source: object, dtype: torch.dtype | str | None = None, variant: str | None = None, *,
            torch_dtype: torch.dtype | str | None = None) -> Inventory:
    """The components of a pipeline folder (headers only, no weight read) or of a loaded pipeline.

    >>> inv = pipemap.inspect("path/to/sdxl", dtype=torch.float16, variant="fp16")   # doctest: +SKIP
    >>> [(c.name, c.bytes) for c in inv.models]                                      # doctest: +SKIP
    """
    target = resolve_dtype(dtype, torch_dtype)
    if variant is not None and not isinstance(variant, str):
        raise ArgumentTypeError("variant", variant, "a string such as 'fp16', or None")
    if isinstance(source, Inventory):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _of_folder(Path(source), target, variant)
    if hasattr(source, "components") and hasattr(source, "config"):
        return _of_pipeline(source, target)
    raise NotAPipelineError(repr(source), "expected a folder path, an Inventory or a loaded DiffusionPipeline")


# ---- folders -----------------------------------------------------------------------------------------------------


def read_model_index(folder: Path) -> dict[str, Any]:
    """The parsed ``model_index.json`` of a pipeline folder, or a NotAPipelineError that says what is wrong."""
    index = folder / "model_index.json"
    if not folder.is_dir():
        raise NotAPipelineError(str(folder), "no such folder")
    if not index.is_file():
        raise NotAPipelineError(str(folder), "it has no model_index.json")
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise NotAPipelineError(str(folder), f"model_index.json is not valid JSON ({err})") from err
    if not isinstance(data, dict) or "_class_name" not in data:
        raise NotAPipelineError(str(folder), "model_index.json has no _class_name")
    return data


def _of_folder(folder: Path, dtype: torch.dtype | None, variant: str | None) -> Inventory:
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
    return Inventory(str(folder), index["_class_name"], tuple(components), _dtype_name(dtype), variant)


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
    headers = {key: meta for f in files for key, meta in read_header(f).items()}
    sizes = {key: _tensor_bytes(meta, key, at, keep, quantized) for key, meta in headers.items()}
    tree = block_tree(sizes)
    mappable = library in _WEIGHTED_LIBRARIES and all(sizes[k] == _stored_bytes(m) for k, m in headers.items())
    return Component(name, library, class_name, sum(sizes.values()), True, in_flight=finest_in_flight(tree),
                     blocks=split_blocks(sizes), tree=tree, attention_width=attention_width(sizes, at.itemsize),
                     files=tuple(f"{name}/{f.name}" for f in files) if mappable else (),
                     heads=_heads(_config(folder / name)))


def _heads(config: Any) -> int:
    heads = config.get("num_attention_heads") if isinstance(config, Mapping) else None
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else 0


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


def _resolves(library: str, class_name: str) -> bool:
    """Whether diffusers' own resolution finds the class (renamed transformers classes included)."""
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
            found |= {v for v in map(_variant_of, (folder / name).iterdir()) if v}
    if variant not in found:
        raise VariantNotFoundError(str(folder), variant, tuple(sorted(found)))


def _variant_of(path: Path) -> str | None:
    """``fp16`` of ``model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors`` or
    ``model.safetensors.index.fp16.json``; None for plain files."""
    name = path.name
    if name.endswith(".json") and ".safetensors.index." in name:
        return name[: -len(".json")].rpartition(".safetensors.index.")[2] or None
    if name.endswith(".safetensors"):
        stem = _SHARD.sub("", name[: -len(".safetensors")])
        return stem.rpartition(".")[2] if "." in stem else None
    return None


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


def weight_files(subfolder: Path, variant: str | None) -> list[Path]:
    """The safetensors files a component loads from: its shard index if any, the ``variant``'s files if present.

    As diffusers does, a component without files of the asked variant falls back to its plain files.
    """
    if not subfolder.is_dir():
        return []
    by_variant: dict[str | None, list[Path]] = {}
    for path in sorted(subfolder.iterdir()):
        if path.name.endswith(".safetensors"):
            stem = _SHARD.sub("", path.name[: -len(".safetensors")])
            by_variant.setdefault(stem.rpartition(".")[2] if "." in stem else None, []).append(path)
    indexed = _indexed_files(subfolder, variant)
    if indexed:
        return indexed
    if not by_variant and any(p.suffix == ".bin" for p in subfolder.iterdir()):
        raise CheckpointError(str(subfolder), "it has only .bin weights; pipemap sizes components from safetensors "
                              "headers: re-save it with safe_serialization=True")
    return by_variant.get(variant) or by_variant.get(None) or []


def _indexed_files(subfolder: Path, variant: str | None) -> list[Path]:
    for suffix in ([f".safetensors.index.{variant}.json"] if variant else []) + [".safetensors.index.json"]:
        for index in sorted(subfolder.glob(f"*{suffix}")):
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(str(index), f"the shard index is unreadable ({err})") from err
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
                    for k, v in weight_map.items()):
                raise CheckpointError(str(index), "its weight_map is not a mapping of tensor names to file names "
                                      "in the same folder")
            files = [subfolder / f for f in sorted(set(weight_map.values()))]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(str(index), f"shards listed in the index are missing: {', '.join(missing)}")
            return files
    return []


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor table of a safetensors file: ``{name: {"dtype": "F16", "shape": [..], ...}}``.

    Reads the 8-byte length and the JSON header and nothing else. safetensors' own ``safe_open`` memory-maps the
    whole file; reading the header with two plain reads keeps "no weight byte is read" checkable (``/proc``
    read counters) and is the format's documented layout. The weights need not follow (a header-only fetch):
    ``check_weights_present`` is what loading asks.
    """
    return _header(path)[0]


def _header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """``read_header`` and the byte the file's tensors end at, as the header places them."""
    try:
        with open(path, "rb", buffering=0) as f:  # unbuffered: a buffered read(8) reads 8 KiB of weights
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(str(path), "the file is shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            size = os.path.getsize(path)
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointError(str(path), f"the header length {length} is larger than the file allows")
            header = json.loads(f.read(length))
    except OSError as err:
        raise CheckpointError(str(path), str(err)) from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(str(path), f"the header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(str(path), f"the header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    for key, meta in header.items():
        if not isinstance(meta, dict) or meta.get("dtype") not in _ELEMENT_BYTES or not _is_shape(meta.get("shape")):
            raise CheckpointError(str(path), f"the entry for tensor {key!r} is malformed: {str(meta)[:200]}")
    end = 8 + length + max((m["data_offsets"][1] for m in header.values() if _is_shape(m.get("data_offsets"))),
                           default=0)
    return header, end


def check_weights_present(folder: Path, index: Mapping[str, Any], variant: str | None,
                          skip: Collection[str] = ()) -> None:
    """Every weights file of ``folder``'s components (but ``skip``, passed in built) holds the bytes its header
    places, else a ``CheckpointError`` naming it, before any load. Planning and the dry run read headers only, so a
    folder fetched header-only (the first bytes of each file) plans; loading reads the weights, and an interrupted
    download would fail there only after reading the rest."""
    for name, entry in index.items():
        if name.startswith("_") or name in skip or not isinstance(entry, list) or not (folder / name).is_dir():
            continue
        for path in weight_files(folder / name, variant) if entry[0] is not None else []:
            end, size = _header(path)[1], os.path.getsize(path)
            if end > size:
                raise CheckpointError(str(path), f"the file is truncated: its header places tensors up to byte "
                                      f"{end}, the file has {size} bytes (a header-only fetch plans and dry-runs; "
                                      "loading needs the weights)")


def _is_shape(shape: object) -> bool:
    """A list of non-negative integers (JSON booleans are not sizes)."""
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def streamed_bytes(sizes: Mapping[str, int]) -> int:
    """The fewest bytes in flight when a component is streamed, from its tensor names: its blocks as fine as they
    go (leaf modules), the two largest of them plus every tensor outside them (``granularity.finest_in_flight``).

    Buffers that are not saved (``position_ids``) are not counted.
    """
    return finest_in_flight(block_tree(sizes))


# the query projection of a self-attention layer: diffusers' ``attn``/``attn1`` (``attn2`` is cross-attention),
# transformers' CLIP ``self_attn``, T5 ``SelfAttention``
_SELF_QUERY = re.compile(r"(?:^|\.)(?:attn1?|self_attn|SelfAttention)\.(?:to_q|q_proj|q)\.weight$")


def attention_width(sizes: Mapping[str, int], itemsize: int) -> int:
    """The widths of a component's self-attention layers, summed (a square query projection of ``w`` x ``w``)."""
    return sum(math.isqrt(size // itemsize) for key, size in sizes.items() if _SELF_QUERY.search(key))


def block_tree(sizes: Mapping[str, int], containers: Iterable[str] | None = None) -> Block:
    """The module tree of a component from its tensor names and bytes (each aligned as in a streaming buffer): a
    tensor belongs to the module its name names without the last part. ``containers`` names the ModuleLists and
    ModuleDicts (from a live module); without it, a module whose children are all numbered is taken for one."""
    own: dict[str, int] = {}
    kids: dict[str, list[str]] = {"": []}
    for key, size in sizes.items():
        module = key.rpartition(".")[0]
        own[module] = own.get(module, 0) + aligned(size)  # as the tensor sits in a streaming buffer
        path, child = module, None
        while path not in kids:  # a module met before has its parents already ("" is the root's)
            kids[path] = [] if child is None else [child]
            path, child = path.rpartition(".")[0], path
        if child is not None:
            kids[path].append(child)
    return _node("", own, kids, None if containers is None else frozenset(containers))


def _node(path: str, own: Mapping[str, int], kids: Mapping[str, list[str]], containers: frozenset[str] | None
          ) -> Block:
    children = tuple(_node(k, own, kids, containers) for k in sorted(kids[path], key=_last_natural))
    if containers is not None:
        container = path in containers
    else:
        container = bool(children) and all(c.path.rpartition(".")[2].isdigit() for c in children)
    mine = own.get(path, 0)
    return Block(path, mine + sum(c.bytes for c in children), mine, children, container and bool(path))


def split_blocks(sizes: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The elements of a component's module lists (``transformer_blocks.7``, ``down_blocks.1``) with their bytes, in
    list order: where a split may cut. Tensors outside every list stay with the component's first GPU."""
    groups: dict[str, int] = {}
    for name, size in sizes.items():
        key = block_key(name)
        if key.rpartition(".")[2].isdigit():
            groups[key] = groups.get(key, 0) + size
    return tuple(sorted(groups.items(), key=lambda item: _natural(item[0])))


def _natural(path: str) -> tuple[tuple[int, int, str], ...]:
    return tuple(map(_natural_part, path.split(".")))


def _last_natural(path: str) -> tuple[int, int, str]:
    """``_natural`` of the last part only: what orders siblings (issue 28: the whole path's was most of a tree's
    time)."""
    return _natural_part(path.rpartition(".")[2])


def _natural_part(part: str) -> tuple[int, int, str]:
    return (0, int(part), "") if part.isdigit() else (1, 0, part)


def live_blocks(module: torch.nn.Module, dtype: torch.dtype | None = None,
                keep_fp32: Iterable[str] = ()) -> tuple[tuple[str, int], ...]:
    """``split_blocks`` of a live module (or one built on the meta device), at ``dtype`` if given."""
    return split_blocks(tensor_sizes(module, dtype, keep_fp32))


def tensor_sizes(module: torch.nn.Module, dtype: torch.dtype | None = None,
                 keep_fp32: Iterable[str] = ()) -> dict[str, int]:
    """``{state_dict key: bytes}`` of a module, each shared tensor under its first key only, at ``dtype`` if given
    (floating tensors only, and those the model class keeps in float32 stay there); a quantized weight (a tensor
    subclass of torchao or quanto) at the bytes it stores, whatever ``dtype``."""
    keep, seen, sizes = tuple(keep_fp32), set(), {}
    for key, tensor in _saved_tensors(module):
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if is_packed(tensor):
            sizes[key] = stored_bytes(tensor)
            continue
        element = tensor.element_size()
        if dtype is not None and tensor.is_floating_point():
            element = 4 if kept_fp32(key, keep) else dtype.itemsize
        sizes[key] = tensor.numel() * element
    return sizes


def _saved_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor | None]]:
    """What ``state_dict(keep_vars=True)`` holds, by module path, without calling it: a quantized module's own
    ``_save_to_state_dict`` (quanto's) splits a weight into its inner tensors, and fails on a dry run's fakes."""
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        yield from ((prefix + k, t) for k, t in sub._parameters.items())
        yield from ((prefix + k, t) for k, t in sub._buffers.items() if k not in sub._non_persistent_buffers_set)


def block_key(name: str) -> str:
    """The block a tensor name belongs to (see ``streamed_bytes``); ``""`` for the root module's own tensors."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return parts[0] if len(parts) > 1 else ""


def submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(module.modules())``: the module and every submodule in the same order, each once, walked with a stack.
    torch's ``modules()`` nests one generator per level, so each module costs a resume per level above it; dispatch
    walks every component three times and each pipeline call once more (``follow``), and those walks were a fifth of
    the time a load added over diffusers' (issue 28)."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        sub = stack.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        found.append(sub)
        if sub._modules:  # a leaf has none: most modules
            stack += [child for child in reversed(sub._modules.values()) if child is not None]
    return found


def near_submodules(module: torch.nn.Module, depth: int) -> list[torch.nn.Module]:
    """The submodules at most ``depth`` levels below ``module`` (not itself), each once, level by level: without
    walking the levels below them, as ``named_modules()`` would."""
    found: list[torch.nn.Module] = []
    seen, level = {id(module)}, [module]
    for _ in range(depth):
        below = []
        for sub in level:
            for child in sub._modules.values():
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    below.append(child)
        found += below
        level = below
    return found


def stream_blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks a streamed component is moved by, in registration order, each module once.

    The elements of the first ModuleList, ModuleDict or Sequential on each path from the root are blocks (a list is
    never one: its own forward never runs); a child holding no such list is one block whole; a child holding one is
    descended into. Tensors outside every block (the root's own, a descended module's own) travel with the root.
    """
    blocks: dict[int, tuple[str, torch.nn.Module]] = {}
    _collect_blocks(module, "", blocks)
    return list(blocks.values())


def _collect_blocks(module: torch.nn.Module, prefix: str, blocks: dict[int, tuple[str, torch.nn.Module]]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, _LISTS):
            for key, element in child.named_children():
                blocks.setdefault(id(element), (f"{path}.{key}", element))
        elif any(isinstance(m, _LISTS) for m in child.modules()):
            _collect_blocks(child, f"{path}.", blocks)
        else:
            blocks.setdefault(id(child), (path, child))


def _stored_bytes(meta: Mapping[str, Any]) -> int:
    """Bytes a tensor takes in its file."""
    return math.prod(int(d) for d in meta["shape"]) * _ELEMENT_BYTES[meta["dtype"]]


def _tensor_bytes(meta: Mapping[str, Any], key: str, dtype: torch.dtype | None, keep_fp32: tuple[str, ...],
                  quantized: bool = False) -> int:
    numel = 1
    for dim in meta["shape"]:
        numel *= int(dim)
    code = meta["dtype"]
    if code not in _FLOATING or quantization_state(key, quantized):  # stored as it will stay
        return numel * _ELEMENT_BYTES[code]
    if kept_fp32(key, keep_fp32):
        return numel * 4
    return numel * (dtype.itemsize if dtype is not None else 4)


def kept_fp32(key: str, keep_fp32: Iterable[str]) -> bool:
    """Whether the tensor named ``key`` lies in one of the kept-fp32 modules (matched by whole name parts, as
    diffusers' loader does)."""
    parts = key.split(".")
    return any(m in parts for m in keep_fp32)


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


# ---- loaded pipelines --------------------------------------------------------------------------------------------


def _of_pipeline(pipe: Any, dtype: torch.dtype | None) -> Inventory:
    components = []
    for name, value in pipe.components.items():
        if isinstance(value, torch.nn.Module):
            components.append(live_component(name, value, dtype))
        else:
            components.append(Component(name, *_origin(value)))
    source = str(getattr(pipe.config, "_name_or_path", "") or type(pipe).__name__)
    return Inventory(source, type(pipe).__name__, tuple(components), _dtype_name(dtype), None)


def live_component(name: str, module: torch.nn.Module, dtype: torch.dtype | None = None,
                   library: str | None = None, class_name: str | None = None) -> Component:
    """A component sized from a live module (or one built on the meta device): its bytes, bytes in flight when
    streamed, and blocks, at ``dtype`` if given (the model class's kept-fp32 modules staying float32)."""
    if library is None:
        library, class_name = _origin(module)
    # a library always comes with its class name (``_origin``, the catalog)
    keep = keep_in_fp32(library, cast(str, class_name), dtype) if library else ()
    sizes = tensor_sizes(module, dtype, keep)
    tree = block_tree(sizes, (n for n, m in module.named_modules() if isinstance(m, _LISTS)))
    itemsize = dtype.itemsize if dtype is not None else next((p.element_size() for p in module.parameters()), 4)
    return Component(name, library, class_name, sum(sizes.values()), True, in_flight=finest_in_flight(tree),
                     blocks=split_blocks(sizes), tree=tree, attention_width=attention_width(sizes, itemsize),
                     files=mapped_files(module, dtype), heads=_heads(getattr(module, "config", None)))


def mapped_files(module: torch.nn.Module, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The safetensors files whose memory maps hold the weights of ``module`` (as diffusers and transformers load
    weights stored at the dtype asked for), or ``()`` when a weight is on a GPU or would be converted, or more than
    ``UNMAPPED_SHARE`` of its bytes are not mapped (buffers built in ``__init__`` never are)."""
    maps, files, unmapped, total = file_maps(), set(), 0, 0
    for tensor in {id(t): t for t in module.state_dict(keep_vars=True).values() if t is not None}.values():
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or (dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype):
            return ()
        found = maps.file_of(address(tensor), nbytes) if nbytes and maps.starts else None
        total += nbytes
        if found is None:
            unmapped += nbytes
        else:
            files.add(found)
    return tuple(sorted(files)) if files and unmapped <= UNMAPPED_SHARE * total else ()


UNMAPPED_SHARE = 0.01



def module_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None, keep_fp32: Iterable[str] = ()) -> int:
    """Bytes of a module's parameters and persistent buffers (shared tensors once), at ``dtype`` if given."""
    return sum(tensor_sizes(module, dtype, keep_fp32).values())


def _origin(value: object) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    return type(value).__module__.split(".")[0], type(value).__name__


@overload
def as_dtype(value: None) -> None:
    ...


@overload
def as_dtype(value: torch.dtype | str) -> torch.dtype:
    ...


@overload
def as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    ...


def as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None:
        return value
    candidate: torch.dtype | None
    if isinstance(value, torch.dtype):
        candidate = value
    elif isinstance(value, str):
        candidate = getattr(torch, value.strip().removeprefix("torch."), None)
        if not isinstance(candidate, torch.dtype):
            raise UnknownDtypeError(value)
    else:
        raise UnknownDtypeError(value, f"a {type(value).__name__} is not a dtype")
    if not candidate.is_floating_point or candidate.itemsize < 2:  # int, bool, complex, fp8: weights don't load so
        raise UnknownDtypeError(value, "pipemap loads weights in a floating dtype of 16 bits or more")
    return candidate


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
