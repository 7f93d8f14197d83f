"""Moving a module's tensors onto their planned devices, each move recorded so that a failed dispatch puts exactly
those back (``Move.undo``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..inventory.live import submodules
from ..runtime.transfer import move_tensor


@dataclass(frozen=True)
class Move:
    """One tensor ``place_module`` moved: enough to put it back if the dispatch fails later."""

    owner: torch.nn.Module
    store: str  # "_parameters" or "_buffers"
    key: str
    original: torch.Tensor
    device: torch.device
    data: torch.Tensor | None = None  # a parameter's .data before the move, which the move replaces in place

    def undo(self) -> None:
        # the data it had, not a copy back: nothing to allocate (a failed dispatch may be out of memory), and
        # nothing lost when the move went where data cannot come back from
        if self.data is not None and self.original.data is not self.data:
            self.original.data = self.data
        getattr(self.owner, self.store)[self.key] = self.original


def place_component(module: torch.nn.Module, placement, moves: list[Move] | None = None) -> list[Move]:
    """A component's tensors onto its planned devices; a split component's blocks straight to theirs, so no GPU
    ever holds the whole of a component that was split because it fits none. Each move is appended to ``moves`` as
    it happens (see ``place_module``)."""
    moves = [] if moves is None else moves
    placed: set[int] = set()
    for path, device, _ in placement.shards:
        block = module.get_submodule(path)
        place_module(block, device, moves=moves)
        placed |= {id(m) for m in block.modules()}
    return place_module(module, placement.device, skip=placed, moves=moves)


def place_module(module: torch.nn.Module, device: str | torch.device, skip: set[int] | frozenset[int] = frozenset(),
                 moves: list[Move] | None = None) -> list[Move]:
    """Move every parameter and buffer not yet on ``device`` there, through the one transfer function; returns what
    it moved, so a failed dispatch can put exactly that back (a load places most tensors already where they go).
    Each move is appended to ``moves`` (when given) before the tensor is replaced, so a failure at any tensor leaves
    the caller a record of every tensor already moved.

    ``module.to`` would do for real tensors, but it reassigns every tensor even when already in place (which fake
    weights of a dry run refuse) and bypasses pipemap's safe-copy routing.
    """
    target = torch.device(device)
    moves = [] if moves is None else moves
    for sub in submodules(module):
        if id(sub) in skip:
            continue
        for key, param in sub._parameters.items():
            if param is not None and param.device != target:
                moves.append(Move(sub, "_parameters", key, param, param.device, param.data))
                _move_parameter(sub, key, param, target)
        for key, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != target:
                moves.append(Move(sub, "_buffers", key, buffer, buffer.device))
                sub._buffers[key] = move_tensor(buffer, target)
    return moves


def _move_parameter(owner: torch.nn.Module, key: str, param: torch.nn.Parameter, target: torch.device) -> None:
    moved = move_tensor(param.data, target)
    try:
        param.data = moved  # keeps the Parameter object, so tied weights stay tied
    except RuntimeError:
        pass
    if param.device != target:  # fake tensors of a dry run refuse (or ignore) .data across devices
        owner._parameters[key] = torch.nn.Parameter(moved, requires_grad=param.requires_grad)
