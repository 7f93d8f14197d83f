"""A component's safetensors files: which ones it loads from (shards, variants) and their headers, read without a
weight byte; the bytes each tensor takes in its file and once loaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..quantized import quantization_state
from .values import Inventory, kept_fp32

# safetensors dtype codes -> bytes per element
_ELEMENT_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_FLOATING = {"F64", "F32", "F16", "BF16"}
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_MAX_HEADER = 100 * 1024 * 1024


def variant_of(path: Path) -> str | None:
    """``fp16`` of ``model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors`` or
    ``model.safetensors.index.fp16.json``; None for plain files."""
    name = path.name
    if name.endswith(".json") and ".safetensors.index." in name:
        return name[: -len(".json")].rpartition(".safetensors.index.")[2] or None
    if name.endswith(".safetensors"):
        stem = _SHARD.sub("", name[: -len(".safetensors")])
        return stem.rpartition(".")[2] if "." in stem else None
    return None


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
    return header_and_end(path)[0]


def header_and_end(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
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
                          skip: Collection[str] = (), sized: Inventory | None = None) -> None:
    """Every weights file of ``folder``'s components (but ``skip``, passed in built) holds the bytes its header
    places, else a ``CheckpointError`` naming it, before any load. Planning and the dry run read headers only, so a
    folder fetched header-only (the first bytes of each file) plans; loading reads the weights, and an interrupted
    download would fail there only after reading the rest. ``sized``: the inventory ``load`` planned from, whose
    components carry each file's end (``Component.ends``), so no header is read a second time."""
    known = {c.name: c.ends for c in sized.models} if sized is not None and sized.variant == variant else {}
    for name, entry in index.items():
        if name.startswith("_") or name in skip or not isinstance(entry, list) or not (folder / name).is_dir():
            continue
        ends = known.get(name) or file_ends(folder, name, weight_files(folder / name, variant)
                                            if entry[0] is not None else [])
        for file, end in ends:
            path = folder / file
            try:
                size = os.path.getsize(path)
            except OSError as err:
                raise CheckpointError(str(path), str(err)) from err
            if end > size:
                raise CheckpointError(str(path), f"the file is truncated: its header places tensors up to byte "
                                      f"{end}, the file has {size} bytes (a header-only fetch plans and dry-runs; "
                                      "loading needs the weights)")


def file_ends(folder: Path, name: str, files: Collection[Path]) -> tuple[tuple[str, int], ...]:
    """``(file below folder, the byte its tensors end at)`` for component ``name``'s ``files``, from their headers."""
    return tuple((f"{name}/{f.name}", header_and_end(f)[1]) for f in files)


def _is_shape(shape: object) -> bool:
    """A list of non-negative integers (JSON booleans are not sizes)."""
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def file_bytes(meta: Mapping[str, Any]) -> int:
    """Bytes a tensor takes in its file."""
    return math.prod(int(d) for d in meta["shape"]) * _ELEMENT_BYTES[meta["dtype"]]


def tensor_bytes(meta: Mapping[str, Any], key: str, dtype: torch.dtype | None, keep_fp32: tuple[str, ...],
                 quantized: bool = False) -> int:
    """Bytes a tensor takes once loaded at ``dtype``: a floating tensor converted (float32 in a kept-fp32 module),
    any other, or a quantized model's stored state, as its file holds it."""
    numel = 1
    for dim in meta["shape"]:
        numel *= int(dim)
    code = meta["dtype"]
    if code not in _FLOATING or quantization_state(key, quantized):  # stored as it will stay
        return numel * _ELEMENT_BYTES[code]
    if kept_fp32(key, keep_fp32):
        return numel * 4
    return numel * (dtype.itemsize if dtype is not None else 4)
