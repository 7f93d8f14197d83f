"""Quantized weights as they are stored: sizes and storage of tensor subclasses, and of quantized checkpoints.

torchao (``Int8Tensor``...) and optimum-quanto (``WeightQBytesTensor``...) keep a weight as a tensor subclass that
reports the float dtype it computes in (``element_size()`` 4 for an int8 weight) and holds its bytes in inner plain
tensors (int8 data, float scales), which both libraries expose through PyTorch's traceable-subclass protocol
(``__tensor_flatten__`` / ``__tensor_unflatten__``, what ``torch.compile`` uses). ``storage`` lists those inner
tensors (recursively: an inner tensor may itself be a subclass, quanto's packed int4), ``stored_bytes`` sums them,
and ``rebuild`` makes the subclass again around other inner tensors (views of a packed buffer on another device):
a quantized weight is then moved as stored, never dequantized on the way.

From a folder: a quantized checkpoint's header already names int8/uint8 storage and its scales; what must not
happen is converting those float scales and quantization states to the dtype asked for (``quantization_state``).
GGUF files (``from_single_file`` with ``GGUFQuantizationConfig``) are sized from their tensor table
(``gguf_sizes``): the ggml type's block size and bytes per block.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

Rebuild = Callable[[list[torch.Tensor]], torch.Tensor]


def is_packed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a subclass that keeps its bytes in inner tensors (a quantized weight)."""
    return is_traceable_wrapper_subclass(tensor)


def storage(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s bytes: itself when plain, else its inner tensors, depth first."""
    if not is_packed(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [leaf for name in names for leaf in storage(getattr(tensor, name))]


def movable(tensor: torch.Tensor) -> bool:
    """Whether offload and streaming can move ``tensor`` through a packed buffer: a plain tensor, or a subclass that
    says what it stores (``is_packed``). Others (bitsandbytes' ``Params4bit``, whose quantization state lives in a
    Python attribute) would lose what the buffer cannot hold."""
    own = type(tensor).__module__.split(".")[0] == "torch"  # torch's own: a dry run's fake tensors
    return own or type(tensor) in (torch.Tensor, torch.nn.Parameter) or is_packed(tensor)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` really stores (a quantized weight: its int data and scales, not its float size)."""
    return sum(t.numel() * t.element_size() for t in storage(tensor))


def rebuild_from(tensor: torch.Tensor) -> Rebuild:
    """``leaves -> tensor``: ``tensor`` made again around other storage (as many leaves as ``storage(tensor)``, same
    dtypes and shapes), a plain tensor being its one leaf."""
    if not is_packed(tensor):
        return lambda leaves: leaves[0]
    names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [(name, rebuild_from(getattr(tensor, name)), len(storage(getattr(tensor, name)))) for name in names]
    cls, size, stride = type(tensor), tensor.size(), tensor.stride()

    def rebuild(leaves: list[torch.Tensor]) -> torch.Tensor:
        parts, at = {}, 0
        for name, make, count in inner:
            parts[name] = make(leaves[at:at + count])
            at += count
        return cls.__tensor_unflatten__(parts, context, size, stride)  # type: ignore[attr-defined,no-any-return]

    return rebuild


def restored(tensor: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
    """``tensor`` made again around ``leaves`` (its storage elsewhere), a Parameter staying one."""
    rebuilt = rebuild_from(tensor)(leaves)
    if isinstance(tensor, torch.nn.Parameter) and not isinstance(rebuilt, torch.nn.Parameter):
        return torch.nn.Parameter(rebuilt, requires_grad=tensor.requires_grad)
    return rebuilt


# ---- checkpoints ---------------------------------------------------------------------------------------------


# tensors of a quantized checkpoint that keep their stored dtype whatever dtype is asked for: quanto's
# ``weight._data``/``weight._scale``, bitsandbytes' ``absmax``/``quant_map``/``SCB``/``quant_state.*``, torchao's
# ``qdata``/``scale``/``zero_point`` when flattened
_QUANT_STATE = re.compile(r"(?:\._data|\._scale|\._shift|\.absmax|\.quant_map|\.nested_absmax|\.nested_quant_map|"
                          r"\.quant_state\.[\w.]+|\.SCB|\.weight_format|\.qdata|\.zero_point|\.input_scale|"
                          r"\.output_scale)$")


def quantization_state(key: str, quantized: bool) -> bool:
    """Whether tensor ``key`` of a checkpoint whose config names a ``quantization_config`` (``quantized``) is part
    of a quantized weight, kept at its stored dtype when the rest converts to the dtype asked for."""
    return quantized and bool(_QUANT_STATE.search(key))


def quantization_method(config: Mapping[str, Any]) -> str | None:
    """The ``quant_method`` a model's ``config.json`` names (``"quanto"``, ``"bitsandbytes"``, ``"torchao"``,
    ``"gguf"``), or None for an unquantized model."""
    found = config.get("quantization_config")
    if isinstance(found, Mapping):
        method = found.get("quant_method")
        return str(method) if method else "unknown"
    return None


def gguf_sizes(path: Path) -> dict[str, int]:
    """``{tensor name: stored bytes}`` of a GGUF file, from its tensor table (gguf's reader maps the file and reads
    only the table here)."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    sizes = {}
    for tensor in GGUFReader(str(path)).tensors:
        block, type_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        elements = int(tensor.n_elements)
        sizes[tensor.name] = elements // block * type_bytes
    return sizes
