"""What a pipeline is made of, and how many bytes each component will take on its device.

From a folder nothing but ``model_index.json`` and the safetensors headers is read; from a loaded pipeline the
sizes come from its modules. Either way the bytes are those of the dtype the component will have once loaded.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ArgumentConflictError, CheckpointError, NotAPipelineError, UnknownDtypeError

# safetensors dtype codes -> bytes per element
_ELEMENT_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_FLOATING = {"F64", "F32", "F16", "BF16"}
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_MAX_HEADER = 100 * 1024 * 1024
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
    in_flight: int = 0  # bytes on the GPU while it runs streamed (its two largest blocks and loose tensors); 0: unknown
    # the repeated blocks a split may cut between, in order: ((module path, bytes), ...); the rest stays whole
    blocks: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if not self.calls_per_image:
            object.__setattr__(self, "calls_per_image", profile_calls(self.name))


def profile_calls(name: str) -> int:
    """Nominal calls per image of a component named ``name``: a denoiser every step, anything else once."""
    return DENOISER_CALLS if name in PER_STEP else 1


@dataclass(frozen=True)
class Inventory:
    """A pipeline's components, sized at the dtype they will be loaded in.

    >>> inv = inspect("path/to/sdxl")                     # doctest: +SKIP
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
    dtype, torch_dtype = _as_dtype(dtype), _as_dtype(torch_dtype)
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ArgumentConflictError("dtype", dtype, "torch_dtype", torch_dtype)
    return dtype if dtype is not None else torch_dtype


def inspect(source, dtype: torch.dtype | str | None = None, variant: str | None = None, *,
            torch_dtype: torch.dtype | str | None = None) -> Inventory:
    """The components of a pipeline folder (headers only, no weight read) or of a loaded pipeline.

    >>> inv = pipemap.inspect("path/to/sdxl", dtype=torch.float16, variant="fp16")   # doctest: +SKIP
    >>> [(c.name, c.bytes) for c in inv.models]                                      # doctest: +SKIP
    """
    target = resolve_dtype(dtype, torch_dtype)
    if isinstance(source, Inventory):
        return source
    if isinstance(source, str) and not os.path.exists(source):
        from . import catalog  # a published pipeline by name ("flux.1-dev"): sized from its configs, no download

        if catalog.resolve(source) is not None:
            return catalog.inventory(source, target)
    if isinstance(source, (str, os.PathLike)):
        return _inspect_folder(Path(source), target, variant)
    if hasattr(source, "components") and hasattr(source, "config"):
        return _inspect_pipeline(source, target)
    raise NotAPipelineError(repr(source), "expected a folder path, an Inventory or a loaded DiffusionPipeline")


# ---- folders -----------------------------------------------------------------------------------------------------


def read_model_index(folder: Path) -> dict:
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


def _inspect_folder(folder: Path, dtype: torch.dtype | None, variant: str | None) -> Inventory:
    index = read_model_index(folder)
    components = []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        library, class_name = entry
        files = weight_files(folder / name, variant) if library is not None else []
        if not files:
            components.append(Component(name, library, class_name))
            continue
        at = dtype if dtype is not None else default_dtype(folder / name, library)
        keep = _keep_in_fp32(library, class_name, at)
        sizes = {key: _tensor_bytes(meta, key, at, keep) for f in files for key, meta in read_header(f).items()}
        components.append(Component(name, library, class_name, sum(sizes.values()), True,
                                    in_flight=streamed_bytes(sizes), blocks=split_blocks(sizes)))
    return Inventory(str(folder), index["_class_name"], tuple(components), _dtype_name(dtype), variant)


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
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(str(index), f"the shard index is unreadable ({err})") from err
            files = [subfolder / f for f in sorted(set(weight_map.values()))]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(str(index), f"shards listed in the index are missing: {', '.join(missing)}")
            return files
    return []


def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file: ``{name: {"dtype": "F16", "shape": [..], ...}}``.

    Reads the 8-byte length and the JSON header and nothing else. safetensors' own ``safe_open`` memory-maps the
    whole file; reading the header with two plain reads keeps "no weight byte is read" checkable (``/proc``
    read counters) and is the format's documented layout.
    """
    try:
        with open(path, "rb", buffering=0) as f:  # unbuffered: a buffered read(8) reads 8 KiB of weights
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(str(path), "the file is shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, os.path.getsize(path) - 8):
                raise CheckpointError(str(path), f"the header length {length} is larger than the file allows")
            header = json.loads(f.read(length))
    except OSError as err:
        raise CheckpointError(str(path), str(err)) from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(str(path), f"the header is not valid JSON ({err})") from err
    header.pop("__metadata__", None)
    for key, meta in header.items():
        if not isinstance(meta, dict) or meta.get("dtype") not in _ELEMENT_BYTES or "shape" not in meta:
            raise CheckpointError(str(path), f"the entry for tensor {key!r} is malformed: {meta!r}")
    return header


def streamed_bytes(sizes: Mapping[str, int]) -> int:
    """Bytes in flight when a component is streamed, from its tensor names: its two largest blocks plus its root's
    own tensors.

    A block is a tensor name up to its first integer part (``down_blocks.1``, ``text_model.encoder.layers.3``, the
    elements of a ModuleList or Sequential); the other names group by their first part (``conv_in``,
    ``text_model``), which can only join blocks that streaming moves separately, so the figure errs high. Buffers
    that are not saved (``position_ids``) are not counted.
    """
    groups: dict[str, int] = {}
    for name, size in sizes.items():
        key = block_key(name)
        groups[key] = groups.get(key, 0) + size
    root = groups.pop("", 0)
    return root + sum(sorted(groups.values(), reverse=True)[:2])


def split_blocks(sizes: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The elements of a component's module lists (``transformer_blocks.7``, ``down_blocks.1``) with their bytes, in
    list order: where a split may cut. Tensors outside every list stay with the component's first GPU."""
    groups: dict[str, int] = {}
    for name, size in sizes.items():
        key = block_key(name)
        if key.rpartition(".")[2].isdigit():
            groups[key] = groups.get(key, 0) + size
    return tuple(sorted(groups.items(), key=lambda item: _natural(item[0])))


def _natural(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def live_blocks(module: torch.nn.Module, dtype: torch.dtype | None = None,
                keep_fp32: Iterable[str] = ()) -> tuple[tuple[str, int], ...]:
    """``split_blocks`` of a live module (or one built on the meta device), at ``dtype`` if given."""
    return split_blocks(tensor_sizes(module, dtype, keep_fp32))


def tensor_sizes(module: torch.nn.Module, dtype: torch.dtype | None = None,
                 keep_fp32: Iterable[str] = ()) -> dict[str, int]:
    """``{state_dict key: bytes}`` of a module, each shared tensor under its first key only, at ``dtype`` if given
    (floating tensors only, and those the model class keeps in float32 stay there)."""
    keep, seen, sizes = tuple(keep_fp32), set(), {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        element = tensor.element_size()
        if dtype is not None and tensor.is_floating_point():
            element = 4 if kept_fp32(key, keep) else dtype.itemsize
        sizes[key] = tensor.numel() * element
    return sizes


@functools.lru_cache(maxsize=65536)  # the same names come back for every plan of a pipeline, and twice in each
def block_key(name: str) -> str:
    """The block a tensor name belongs to (see ``streamed_bytes``); ``""`` for the root module's own tensors."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return parts[0] if len(parts) > 1 else ""


def stream_blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks a streamed component is moved by, in registration order, each module once.

    The elements of the first ModuleList, ModuleDict or Sequential on each path from the root are blocks (a list is
    never one: its own forward never runs); a child holding no such list is one block whole; a child holding one is
    descended into. Tensors outside every block (the root's own, a descended module's own) travel with the root.
    """
    blocks: dict[int, tuple[str, torch.nn.Module]] = {}
    _collect_blocks(module, "", blocks)
    return list(blocks.values())


def _collect_blocks(module: torch.nn.Module, prefix: str, blocks: dict) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, _LISTS):
            for key, element in child.named_children():
                blocks.setdefault(id(element), (f"{path}.{key}", element))
        elif any(isinstance(m, _LISTS) for m in child.modules()):
            _collect_blocks(child, f"{path}.", blocks)
        else:
            blocks.setdefault(id(child), (path, child))


def _tensor_bytes(meta: Mapping, key: str, dtype: torch.dtype | None, keep_fp32: tuple[str, ...]) -> int:
    numel = 1
    for dim in meta["shape"]:
        numel *= int(dim)
    code = meta["dtype"]
    if code not in _FLOATING:
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
                    trust_remote_code: bool = False) -> type:
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
    return cls


def _keep_in_fp32(library: str, class_name: str, dtype: torch.dtype | None) -> tuple[str, ...]:
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


def _inspect_pipeline(pipe, dtype: torch.dtype | None) -> Inventory:
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
    keep = _keep_in_fp32(library, class_name, dtype) if library else ()
    size = module_bytes(module, dtype, keep)
    return Component(name, library, class_name, size, True, in_flight=min(size, _live_in_flight(module, dtype)),
                     blocks=live_blocks(module, dtype, keep))


def module_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None, keep_fp32: Iterable[str] = ()) -> int:
    """Bytes of a module's parameters and persistent buffers (shared tensors once), at ``dtype`` if given."""
    return sum(tensor_sizes(module, dtype, keep_fp32).values())


def _live_in_flight(module: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """``streamed_bytes`` of a live module, from the blocks streaming will really use."""
    sizes = sorted((module_bytes(block, dtype) for _, block in stream_blocks(module)), reverse=True)
    return module_bytes(module, dtype) - sum(sizes) + sum(sizes[:2])


def _origin(value) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    return type(value).__module__.split(".")[0], type(value).__name__


def _as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    candidate = getattr(torch, name, None)
    if not isinstance(candidate, torch.dtype):
        raise UnknownDtypeError(value)
    return candidate


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
