"""What travels between a split's ranks (``workers.py``, ``worker.py``): a structure pickled with its tensors left
out (``packed``/``unpacked``: each tensor a reference, sent through the process group or named where the receiver
holds it), the tensors of a call a worker holds from the last one (``Inputs``), what a receiver allocates before a
tensor arrives (``Meta``), a hash of a tensor's bytes to compare copies without moving them (``digest``), and an
exception a caller expects back as a value (``Raised``).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import pickle
from dataclasses import dataclass
from typing import Any

import torch

# ---- the digest of a tensor's bytes -------------------------------------------------------------------------------

_CHUNK = 1 << 24


def digest(tensor: torch.Tensor) -> str:
    """A hash of the tensor's bytes (BLAKE2b, 128 bits), alike on every device, so a worker and rank 0 compare their
    copies without moving them between processes. A real hash (WP12): two sums, as it was, kept a swap of two
    elements 65521 apart. A GPU tensor is hashed in 16 MiB pieces read back to the host."""
    flat = tensor.detach().contiguous().reshape(-1)
    hashed = hashlib.blake2b(digest_size=16)
    data = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    for start in range(0, data.numel(), _CHUNK):
        hashed.update(data[start:start + _CHUNK].cpu().numpy().data)
    return hashed.hexdigest()


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its dotted name (a shared tensor under its first name)."""
    found: dict[str, torch.Tensor] = {}
    for name, tensor in itertools.chain(module.named_parameters(remove_duplicate=False),
                                        module.named_buffers(remove_duplicate=False)):
        found.setdefault(name, tensor)
    return found


@dataclass(frozen=True)
class Meta:
    """A tensor on the wire: what the receiver allocates before the tensor arrives."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: bool = False


# ---- pickling with the tensors left out --------------------------------------------------------------------------


class Pickler(pickle.Pickler):
    """Pickles a structure with each tensor replaced by a reference: ``("keep", name)`` where the receiver already
    holds that tensor (``keep``: id -> name), else ``("sent", i)``, the tensor appended to ``sent``."""

    def __init__(self, file, keep: dict[int, str] | None = None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.keep = keep or {}
        self.sent: list[torch.Tensor] = []
        self.tensors: list[tuple[torch.Tensor, str | int]] = []  # each tensor met, as it was, and its name or index
        self.from_main: set[str] = set()  # the classes of ``__main__`` met (``travel_problem``)

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            kind = obj if isinstance(obj, type) else type(obj)
            if getattr(kind, "__module__", None) == "__main__":
                self.from_main.add(kind.__qualname__)
            return None
        if id(obj) in self.keep:
            self.tensors.append((obj, self.keep[id(obj)]))
            return ("keep", self.keep[id(obj)], isinstance(obj, torch.nn.Parameter))
        self.sent.append(obj.detach())
        self.tensors.append((obj, len(self.sent) - 1))
        return ("sent", len(self.sent) - 1, isinstance(obj, torch.nn.Parameter))


class Unpickler(pickle.Unpickler):
    def __init__(self, file, received: list[torch.Tensor], kept: dict[str, torch.Tensor] | None = None):
        super().__init__(file)
        self.received, self.kept = received, kept or {}
        self.used: dict[str, torch.Tensor] = {}  # the kept tensors the structure named

    def persistent_load(self, pid):
        kind, key, parameter = pid
        tensor = self.kept[key] if kind == "keep" else self.received[key]
        if kind == "keep":
            self.used[key] = tensor
        if parameter and not isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(tensor, requires_grad=False)
        return tensor


def packed(value, keep: dict[int, str] | None = None) -> tuple[bytes, list[torch.Tensor]]:
    """``value`` pickled without its tensors, and the tensors to send after it."""
    buffer = io.BytesIO()
    pickler = Pickler(buffer, keep)
    pickler.dump(value)
    return buffer.getvalue(), pickler.sent


def unpacked(data: bytes, received: list[torch.Tensor], kept: dict[str, torch.Tensor] | None = None):
    return Unpickler(io.BytesIO(data), received, kept).load()


class Inputs:
    """The tensors of the last call sent to one worker, held here (so no other tensor can take an ``id`` while
    they are compared) and there by name: a tensor of the next call that is the same object at the same version
    (``Tensor._version``, moved by every in-place write) is named, not sent. A pipeline that calls its denoiser per
    guidance branch passes the same prompt embeddings at every step: they cross once per call of the pipeline,
    not once per step (issue 34)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[torch.Tensor, int | None, str]] = {}
        self.serial = 0

    def keep(self) -> dict[int, str]:
        return {key: name for key, (t, version, name) in self.held.items() if version == _version(t) is not None}

    def packed(self, value) -> tuple[bytes, list[torch.Tensor], list[str]]:
        """``value`` pickled as ``packed`` does, the tensors to send, and the names the worker keeps them by."""
        buffer = io.BytesIO()
        pickler = Pickler(buffer, self.keep())
        pickler.dump(value)
        self.serial += 1
        names = [f"{self.serial}/{i}" for i in range(len(pickler.sent))]
        self.held = {id(t): (t, _version(t), key if isinstance(key, str) else names[key]) for t, key in pickler.tensors}
        return buffer.getvalue(), pickler.sent, names

    def forget(self) -> None:
        self.held = {}


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; None for an inference-mode tensor, which keeps none (so is always sent)."""
    return None if tensor.is_inference() else tensor._version


def received_inputs(data: bytes, received: list[torch.Tensor], names: list[str], kept: dict[str, torch.Tensor]
                    ) -> tuple[Any, dict[str, torch.Tensor]]:
    """A call's structure with its tensors put back (those named from ``kept``, the worker's last call's), and
    what the worker holds for the next call: this call's tensors by name."""
    unpickler = Unpickler(io.BytesIO(data), received, kept)
    value = unpickler.load()
    return value, {**unpickler.used, **dict(zip(names, received))}


def metas(tensors: list[torch.Tensor]) -> list[Meta]:
    return [Meta(tuple(t.shape), t.dtype) for t in tensors]




@dataclass(frozen=True)
class Raised:
    """An exception a worker's call raised that its caller expects (``Workers.send(expected=...)``)."""

    kind: str
    message: str


