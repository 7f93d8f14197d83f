"""diffusers' context parallelism on pipemap's groups: a copy of a transformer made one rank of a sequence split
(``enable_split``), over a ``torch.distributed`` group of worker processes or an in-process group of threads
(``exchange.ThreadGroup``), without the default process group and device mesh diffusers' own ``enable_parallelism``
needs: its attention processors take the context-parallel path (Ulysses, queries, keys and values in one exchange:
``ulysses.py``), and the model class's ``_cp_plan`` cuts the inputs and gathers the output at the layers it names
(``_Cut``/``_Gather``: diffusers' own split and gather hooks with the rank read from here). What ``sequence.py``'s
hook, the thread ranks and the worker processes share; the hook's module is ``sequence.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from diffusers.hooks.context_parallel import (
    ContextParallelGatherHook,
    ContextParallelSplitHook,
    _get_submodule_by_name,
)
from diffusers.hooks.hooks import HookRegistry
from diffusers.models._modeling_parallel import ContextParallelConfig, ContextParallelInput, ParallelConfig
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from ..errors import PlanMismatchError, Unsplittable
from ..replication import SEQUENCE_BROKEN
from .ulysses import FUSED, symbolic
from .ulysses import install as install_fused

_HOOK_NAME = "pipemap-sequence---{}"


def check_splittable(component: str, module: torch.nn.Module, ranks: int) -> None:
    """Raise ``PlanMismatchError`` unless ``module`` can split its tokens ``ranks`` ways: a ``_cp_plan`` whose
    diffusers path is exact (``replication.SEQUENCE_BROKEN``), attention heads that divide among the ranks (Ulysses
    gives each GPU a share of the heads), an attention backend with a context-parallel path."""
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if not getattr(module, "_cp_plan", None):
        reason = f"{type(module).__name__} has no context-parallel plan (_cp_plan) to split its tokens by"
    elif type(module).__name__ in SEQUENCE_BROKEN:
        name = type(module).__name__
        reason = f"diffusers' context-parallel {name} is not exact: {SEQUENCE_BROKEN[name]}"
    elif not isinstance(heads, int) or heads % ranks:
        reason = f"its {heads} attention heads do not divide among {ranks} GPUs"
    else:
        backend = next((p._attention_backend for p in _processors(module)), None)
        name = AttentionBackendName(backend) if backend else _AttentionBackendRegistry.get_active_backend()[0]
        if _AttentionBackendRegistry._is_context_parallel_available(name):
            return
        reason = f"its attention backend {name.value!r} has no context-parallel path"
    raise PlanMismatchError(component, f"{reason}; re-plan it for fewer GPUs, or with strategy 'balanced'")


def _processors(module: torch.nn.Module) -> list:
    return [m.processor for m in module.modules()
            if hasattr(getattr(m, "processor", None), "_parallel_config")]


def enable_split(module: torch.nn.Module, rank: int, group: Any) -> None:
    """Make ``module`` (a copy) rank ``rank`` of a sequence split over ``group``: its attention processors take the
    context-parallel path (Ulysses over ``group``), and its ``_cp_plan`` cuts and gathers at the layers it names."""
    ranks = group.size()
    context = ContextParallelConfig(ulysses_degree=ranks)
    mesh: Any = _Mesh(group, rank)
    whole: Any = _Mesh(group, 0)
    # what ContextParallelConfig.setup would set from a torch.distributed DeviceMesh
    context._rank, context._world_size, context._mesh, context._flattened_mesh = rank, ranks, mesh, mesh
    context._ulysses_mesh, context._ulysses_local_rank, context._ring_mesh, context._ring_local_rank = (
        mesh, rank, whole, 0)
    install_fused()  # queries, keys and values in one exchange (``ulysses.py``: diffusers sends them in three)
    setattr(context, FUSED, True)
    config = ParallelConfig(context_parallel_config=context)
    config._rank, config._world_size = rank, ranks
    for processor in _processors(module):
        processor._parallel_config = config
    for path, entry in cast(dict, module._cp_plan).items():
        found = _get_submodule_by_name(module, path)
        for sub in found if isinstance(found, list) else [found]:
            hook = _Cut(entry, context, rank) if isinstance(entry, dict) else _Gather(entry, context, group)
            HookRegistry.check_if_exists_or_initialize(sub).register_hook(hook, _HOOK_NAME.format(path))


class _Mesh:
    """The part of a ``DeviceMesh`` diffusers' Ulysses attention reads: its group and this rank's place in it."""

    def __init__(self, group: Any, rank: int):
        self.group, self.rank = group, rank

    def get_group(self) -> Any:
        return self.group

    def size(self) -> int:
        return self.group.size()

    def get_local_rank(self) -> int:
        return self.rank


class _Cut(ContextParallelSplitHook):
    """diffusers' split hook, cutting this rank's share (its own sharder asks torch.distributed for the rank)."""

    def __init__(self, metadata, context: ContextParallelConfig, rank: int):
        super().__init__(metadata, context)
        self.rank, self.ranks = rank, context.ulysses_degree or 1

    def _prepare_cp_input(self, x: torch.Tensor, cp_input: ContextParallelInput) -> torch.Tensor:
        if cp_input.expected_dims is not None and x.dim() != cp_input.expected_dims:
            return x  # as diffusers: a tensor of another rank is passed whole (Wan's 1-D timestep)
        if x.shape[cp_input.split_dim] % self.ranks:
            raise Unsplittable(f"{tuple(x.shape)} along {cp_input.split_dim} among {self.ranks}")
        return x.chunk(self.ranks, dim=cp_input.split_dim)[self.rank]


class _Gather(ContextParallelGatherHook):
    """diffusers' gather hook, through the thread group (its own asks torch.distributed for the rank)."""

    def __init__(self, metadata: Any, context: ContextParallelConfig, group: Any):
        entries: Any = metadata if isinstance(metadata, (list, tuple)) else [metadata]
        super().__init__(entries, context)
        self.group = group

    def post_forward(self, module, output):
        single = isinstance(output, torch.Tensor)
        outputs = [output] if single else list(output)
        entries: list[Any] = list(cast(Any, self.metadata))
        for i, entry in enumerate(entries):
            if entry is not None:
                outputs[i] = gather(outputs[i], entry.gather_dim, self.group)
        return outputs[0] if single else type(output)(outputs)


def gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` joined along ``dim``, in rank order."""
    home = x.device
    if home.type != "cpu" and group.name() == "gloo":  # two ranks on one GPU (``workers.shared_gpu``): gloo's
        x = x.cpu()  # all-gather read a GPU tensor as host memory (a segfault on the H200): through the host
    x = x.contiguous()
    if symbolic(x) or x.requires_grad:  # stand-ins, or a graph to backpropagate through: the functional op
        joined = funcol.wait_tensor(_all_gather(x, 0, group)).to(home)
        return torch.cat(joined.chunk(group.size(), dim=0), dim=dim) if dim else joined
    parts = [torch.empty_like(x) for _ in range(group.size())]  # as ulysses.exchange: no functional wrapping
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim).to(home)


def all_gather_op(functional: Any = funcol) -> Any:
    """torch's functional all-gather: ``all_gather_single`` since torch 2.13 (``all_gather_tensor`` is deprecated
    there), ``all_gather_tensor`` in torch 2.11 and older, which lack the new name (the H200 run of bench/workers.py
    found it); the same op either way."""
    return getattr(functional, "all_gather_single", None) or functional.all_gather_tensor


_all_gather = all_gather_op()
