"""The dry run's work counter: FLOPs, bytes read and written, and kernels launched, by the component and module
running each operation, at the call's own shapes.

torch's ``FlopCounterMode`` counts FLOPs on fake tensors, by module; what it lacks here is the bytes and kernels of
the same pass, the split between the work done once per image and the work of each denoising step, and the calls of
each component, so the counter is a dispatch mode of its own that uses torch's FLOP formulas
(``torch.utils.flop_counter.flop_registry``) for every operation they know.
"""

from __future__ import annotations

import collections

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from ..counts import PIPELINE, ComponentCounts, Counts, Tally
from .trackers import _phase_kind, _with_replicas

aten = torch.ops.aten
# operations that launch no kernel: allocations, and views not marked as such in their schema
_NO_KERNEL = {aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default,
              aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default, aten.set_.source_Storage,
              aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.lift_fresh.default,
              aten._local_scalar_dense.default, aten.is_same_size.default, aten.sym_size.int, aten.sym_stride.int,
              aten.sym_numel.default, aten.sym_storage_offset.default}
_COPIES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}


def _cpu_attention_flops(query, key, value, *args, **kwargs) -> int:
    # the CPU's fused attention, which the FLOP registry does not list: the same count as its GPU kernels
    return sdpa_flop_count(query.shape, key.shape, value.shape)


_EXTRA_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}
# the fused attention kernels (their forward): counted as a work class of their own, priced by backend
_ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu}
_FIGURES = len(Tally().to_list())


class WorkCounter(TorchDispatchMode):
    """Counts every operation's FLOPs, bytes and kernels into the component and innermost module running it (from
    global module hooks), as per-step work during the denoising loop and once-per-image work outside it.

    A component's phase is its name's (``trackers``: a denoiser or ControlNet works per step); the pipeline's own
    code works per step from a per-step component's call until the next call of another component (the scheduler,
    guidance and latents between the denoiser's calls).
    """

    def __init__(self, pipe):
        super().__init__()
        self._owner: dict[int, tuple[str, str]] = {}
        self._roots: set[int] = set()
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module):
                for held in _with_replicas(pipe, name):
                    self._roots.add(id(held))
                    self._owner.update({id(m): (name, path) for path, m in held.named_modules()})
        self._scheduler = getattr(pipe, "scheduler", None)
        self.steps = 0  # the scheduler's steps taken: the denoising loop's iterations
        self._in_loop = False
        self._stack: list[tuple[str, str]] = []
        self._last: str | None = None
        self.work: dict[tuple[str, bool], list[float]] = collections.defaultdict(lambda: [0.0] * _FIGURES)
        self.pieces: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0] * _FIGURES)
        self.root_calls: collections.Counter = collections.Counter()
        self.runs: collections.Counter = collections.Counter()
        self._handles: list = []

    # ---- where the call is

    def _per_step(self, component: str | None) -> bool:
        if component is None:
            return self._in_loop
        return _phase_kind(component, "") == "denoising"

    def _enter(self, module, *args) -> None:
        owner = self._owner.get(id(module))
        if owner is None:
            return
        name = owner[0]
        if not any(c == name for c, _ in self._stack):  # a call of this component starts
            key = (name, self._per_step(name))
            self._in_loop = key[1]
            if id(module) in self._roots:
                self.root_calls[key] += 1
            elif self._last != name:
                self.runs[key] += 1
            self._last = name
        self._stack.append(owner)

    def _leave(self, module, *args) -> None:
        if id(module) in self._owner and self._stack:
            self._stack.pop()

    def __enter__(self):
        self._handles = [nn_module.register_module_forward_pre_hook(self._enter),
                         nn_module.register_module_forward_hook(self._leave)]
        if self._scheduler is not None:
            self._previous = self._scheduler.__dict__.get("step")  # another watcher's wrapper, if any
            step = self._scheduler.step

            def counted(*args, **kwargs):
                self.steps += 1
                return step(*args, **kwargs)

            self._scheduler.__dict__["step"] = counted
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        if self._scheduler is not None:
            if self._previous is None:
                self._scheduler.__dict__.pop("step", None)
            else:
                self._scheduler.__dict__["step"] = self._previous
        return super().__exit__(*exc)

    # ---- what each operation costs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _launches_kernel(func, out) or _crosses_devices(func, args, kwargs, out):
            return out
        inputs = tree_leaves((args, kwargs))
        flops = _flops(func, args, kwargs, out)
        wide = flops if _first_dtype(inputs) == torch.float32 else 0.0
        moved = _bytes(inputs) + _bytes(tree_leaves(out))
        component, path = self._stack[-1] if self._stack else (None, "")
        name = component or PIPELINE
        fused = func._overloadpacket in _ATTENTION
        for into in (self.work[(name, self._per_step(component))], self.pieces[(name, path)]):
            into[0] += flops
            into[1] += wide
            into[2] += moved
            into[3] += 0 if flops else moved
            into[4] += 1
            if fused:
                into[5] += flops
                into[6] += moved
                into[7] += _scores(args)
        return out

    # ---- the result

    def counts(self, pipeline_class: str, shape, steps_asked: int, steps: int, dtype: str | None) -> Counts:
        """The counts of the call that asked for ``steps_asked`` denoising steps, for a call of ``steps`` steps.
        Per-step work is per iteration of the loop (the scheduler's steps, which may be one more than asked: PNDM's
        warm-up)."""
        names = dict.fromkeys(name for name, _ in self.work)
        iterations = self.steps or steps_asked
        return Counts(pipeline_class, tuple(shape), steps,
                      tuple(self._component(name, iterations) for name in names), dtype, "dry run",
                      extra_steps=iterations - steps_asked)

    def _component(self, name: str, steps_run: int) -> ComponentCounts:
        once, per_step = (Tally(*self.work.get((name, flag), [0.0] * _FIGURES)) for flag in (False, True))
        calls_once, calls_step = (self.root_calls[(name, flag)] or self.runs[(name, flag)] for flag in (False, True))
        steps = max(1, steps_run)
        calls = max(1, calls_once + calls_step)
        pieces = tuple((path, Tally(*values).scaled(1.0 / calls)) for (owner, path), values in self.pieces.items()
                       if owner == name)
        return ComponentCounts(name, once, per_step.scaled(1.0 / steps), float(calls_once), calls_step / steps,
                               pieces)


def _flops(func, args, kwargs, out) -> float:
    formula = flop_registry.get(func._overloadpacket) or _EXTRA_FLOPS.get(func._overloadpacket)
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


def _scores(args) -> float:
    """Elements of the score matrices a fused attention kernel keeps on chip: batch x heads x queries x keys."""
    query, key = args[0], args[1]
    return float(query.numel() // query.shape[-1] * key.shape[-2])


def _first_dtype(leaves) -> torch.dtype | None:
    return next((t.dtype for t in leaves if isinstance(t, torch.Tensor)), None)


def _bytes(leaves) -> float:
    seen: set[int] = set()
    total = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            # a broadcast view (stride 0) reads its storage once, not once per element
            total += min(leaf.numel() * leaf.element_size(), _storage_bytes(leaf))
    return float(total)


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


def _launches_kernel(func, out) -> bool:
    """Whether an operation runs a kernel: it returns a tensor (``prim.device`` and size queries do not), is no view
    and no bare allocation."""
    if getattr(func, "is_view", False) or func in _NO_KERNEL:
        return False
    return any(isinstance(t, torch.Tensor) for t in tree_leaves(out))


def _crosses_devices(func, args, kwargs, out) -> bool:
    """A copy from one device to another: weights or inputs moving, which the cost model prices as transfers."""
    if func not in _COPIES:
        return False
    devices = {t.device for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
    return len(devices) > 1


def launches_kernel(func, out) -> bool:
    """Whether an operation runs a kernel, as the counter counts kernels (``pipemap doctor`` times the host's launches
    over the same count)."""
    return _launches_kernel(func, out)
