"""A component split across GPUs (mode ``"split"``): its root on one GPU, blocks on others, activations passed on
directly between consecutive blocks on one GPU."""

from __future__ import annotations

from accelerate.hooks import add_hook_to_module

from .resident import PlacementHook, unhook_component


class SplitHook(PlacementHook):
    """A component cut across GPUs: its root on ``device``, each block of ``shards`` on its own GPU with a hook that
    brings the block's inputs there. A run of consecutive blocks of one list on one GPU passes activations on
    directly; only the last block of the run returns its outputs to ``device`` (the dry run proves a plan's
    component touches nothing of them between two blocks)."""

    def __init__(self, component: str, device: str, execution_device: str, shards: tuple[tuple[str, str, int], ...]):
        super().__init__(component, device, execution_device)
        self.shards = shards

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger) -> SplitHook:
        """The hook of a split placement (``hooks.HOOKS``): the blocks of ``p.shards`` on their GPUs."""
        return cls(p.component, p.device, execution_device, p.shards)

    def init_hook(self, module):  # dispatch has placed the blocks already (``_place``)
        for (path, device, _), last in zip(self.shards, _run_ends(self.shards)):
            add_hook_to_module(module.get_submodule(path), PlacementHook(f"{self.component}.{path}", device,
                                                                         str(self.device) if last else device))
        return module

    def detach_hook(self, module):
        for path, _, _ in self.shards:
            unhook_component(module.get_submodule(path))
        return module


def _run_ends(shards: tuple[tuple[str, str, int], ...]) -> list[bool]:
    """For each shard, whether it ends a run: the next shard is not the next element of its list on its GPU."""
    ends = []
    for (path, device, _), following in zip(shards, [*shards[1:], None]):
        prefix, _, index = path.rpartition(".")
        ends.append(following is None or following[1] != device or not index.isdigit()
                    or following[0] != f"{prefix}.{int(index) + 1}")
    return ends
