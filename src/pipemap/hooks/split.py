"""A component split across GPUs (mode ``"split"``): its root on one GPU, blocks on others, activations passed on
directly between consecutive blocks on one GPU."""

from __future__ import annotations

import functools
import weakref

import torch
from accelerate.hooks import add_hook_to_module
from torch.utils._pytree import tree_map

from ..runtime.transfer import move, move_tensor
from .resident import PlacementHook, copied_containers, outside_graphs, unhook_component


class SplitHook(PlacementHook):
    """A component cut across GPUs: its root on ``device``, each block of ``shards`` on its own GPU with a hook that
    brings the block's inputs there. A run of consecutive blocks of one list on one GPU passes activations on
    directly; only the last block of the run returns its outputs to ``device`` (the dry run proves a plan's
    component touches nothing of them between two blocks). Inputs every block takes unchanged (a timestep
    embedding, rotary tables) are copied to each GPU once per call (``CallInputs``)."""

    def __init__(self, component: str, device: str, execution_device: str, shards: tuple[tuple[str, str, int], ...]):
        super().__init__(component, device, execution_device)
        self.shards = shards
        self.inputs = CallInputs()

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger) -> SplitHook:
        """The hook of a split placement (``hooks.HOOKS``): the blocks of ``p.shards`` on their GPUs."""
        return cls(p.component, p.device, execution_device, p.shards)

    def init_hook(self, module):  # dispatch has placed the blocks already (``_place``)
        for (path, device, _), last in zip(self.shards, _run_ends(self.shards)):
            add_hook_to_module(module.get_submodule(path), ShardHook(
                f"{self.component}.{path}", device, str(self.device) if last else device, self.inputs))
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.inputs.clear()
        return super().pre_forward(module, *args, **kwargs)

    def post_forward(self, module, output):
        self.inputs.clear()
        return super().post_forward(module, output)

    def abort(self, module) -> None:
        self.inputs.clear()  # the failed call's copies are not kept until the next call

    def detach_hook(self, module):
        for path, _, _ in self.shards:
            unhook_component(module.get_submodule(path))
        self.inputs.clear()
        return module


class ShardHook(PlacementHook):
    """A block on its GPU: its inputs brought there through the call's ``CallInputs``."""

    def __init__(self, component: str, device: str, execution_device: str, inputs: CallInputs):
        super().__init__(component, device, execution_device)
        self.inputs = inputs

    def pre_forward(self, module, *args, **kwargs):
        self.moved.calls += 1
        given = (args, kwargs)
        args, kwargs = self.inputs.move(given, self.device)
        moved = move(args, self.device), move(kwargs, self.device)  # what the tree walk does not reach
        # lists the block fills in (Wan's VAE causal cache, ``feat_cache``) are written back at its end (post_forward)
        self.written.append(copied_containers(given, moved))
        return moved


class CallInputs:
    """The copies of one call's block inputs on each GPU, by the identity (and version) of the tensor copied: a
    tensor every block takes crosses to a GPU once per call, not once per block. A copy is dropped as soon as its
    source is, so activations passed along are not held; ``clear`` at each call's start and end drops the rest."""

    def __init__(self):
        self.copies: dict[tuple[int, torch.device], tuple[int, torch.Tensor, weakref.ref]] = {}

    def move(self, tree, device: torch.device):
        return tree_map(lambda leaf: self._moved(leaf, device) if isinstance(leaf, torch.Tensor) else leaf, tree)

    def _moved(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        key = (id(tensor), device)
        entry = self.copies.get(key)
        if entry is not None and entry[2]() is tensor and entry[0] == tensor._version:
            return entry[1]
        moved = move_tensor(tensor, device)
        self.copies[key] = (tensor._version, moved, weakref.ref(tensor, functools.partial(self._forget, key)))
        return moved

    def _forget(self, key: tuple[int, torch.device], _) -> None:
        self.copies.pop(key, None)

    def clear(self) -> None:
        self.copies.clear()


def _run_ends(shards: tuple[tuple[str, str, int], ...]) -> list[bool]:
    """For each shard, whether it ends a run: the next shard is not the next element of its list on its GPU."""
    ends = []
    for (path, device, _), following in zip(shards, [*shards[1:], None]):
        prefix, _, index = path.rpartition(".")
        ends.append(following is None or following[1] != device or not index.isdigit()
                    or following[0] != f"{prefix}.{int(index) + 1}")
    return ends


outside_graphs(SplitHook)
