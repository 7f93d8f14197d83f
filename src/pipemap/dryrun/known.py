"""Known values in the dry run: what is computed only from real inputs keeps its real value beside its stand-in.

Only weights must be fake. Token ids and masks, input images, timesteps, sigmas and Python scalars are real, and
pipeline and scheduler code reads them (``.item()``, ``.tolist()``, ``image.min() < 0``, ``x[mask]``, slicing by
``mask.sum()``). A fake tensor cannot answer such reads, so each fake computed only from real values carries its real
CPU value: an operation whose tensor inputs are all known is also run for real, on the CPU, outside every mode.

Why a dispatch mode beside the fakes, and not FakeTensor's own constants: fake mode keeps constants for one-element
tensors only and drops them when a tensor moves to a device; a stand-in (``meta:0``) cannot hold a real value at all.
Here the fake still does the device checks and the byte counting (a known tensor on ``meta:0`` counts as that
device's bytes); the CPU copy is never counted, and is dropped above ``LIMIT`` elements so it stays cheap.

A value that depends on weights and is still read as data (a mixture of experts' routing counts) cannot be known:
the engine then assumes an upper bound (every token routed to one expert, every mask entry true) and says so
through ``on_bound``, so the report can mark the peaks that are bounds rather than exact.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import UnknownValueError

aten = torch.ops.aten
LIMIT = 1 << 24  # elements: a known value larger than this (an attention mask over a whole video) becomes unknown
DRAWN = 16  # elements: a random draw from no tensor up to this size (seeds, a random index) is drawn for real
_ATTR = "_pipemap_known"
_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_MASKED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._unsafe_index.Tensor}
# what CUDA autocast runs in its lower precision: the matmul and convolution kernels, as dispatch sees them
_AUTOCAST = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.addbmm.default,
             aten.convolution.default, aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_flash_attention.default}


_LEAVES = frozenset({int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device, torch.memory_format,
                     torch.layout})  # leaves no tensor hides in: skipped without asking pytree


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors among ``tree``'s leaves, in ``tree_flatten``'s order: what a dispatch mode reads of an operation's
    arguments or outputs. Plain tuples, lists and dicts are walked here, without building pytree's spec: every
    operation of a dry run passes several modes, each of which looks (a third of a full-size dry run's time went to
    pytree). Any other container is pytree's."""
    found: list[torch.Tensor] = []
    _collect(tree, found)
    return found


def _collect(tree, found: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _collect(item, found)
    elif kind is dict:
        for item in tree.values():
            _collect(item, found)
    elif isinstance(tree, torch.Tensor):
        found.append(tree)
    elif kind not in _LEAVES:  # a named tuple, an OrderedDict, a registered node: pytree walks it
        found.extend(t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def real_value(tensor) -> torch.Tensor | None:
    """The real CPU value of a dry-run tensor, or None when it depends on weights. A real tensor is its own value."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if not isinstance(tensor, FakeTensor):
        return tensor
    return tensor.__dict__.get(_ATTR)


class KnownValues(TorchDispatchMode):
    """Run each operation on the fakes, and for real on the CPU when every tensor input has a known value.

    ``on_bound(note)`` is called when a value read as data had to be assumed (an upper bound); ``autocast`` is the
    stack of stand-in autocast states (enabled, dtype) that :func:`standin_autocast` pushes.
    """

    def __init__(self, on_bound: Callable[[str], None] | None = None):
        super().__init__()
        self.on_bound = on_bound or (lambda note: None)
        self.bounds: list[str] = []
        self.autocast: list[tuple[bool, torch.dtype]] = []
        self._poisoned: set[int] = set()

    def value(self, tensor) -> torch.Tensor | None:
        real = real_value(tensor)
        if real is not None and isinstance(tensor, FakeTensor) and id(tensor.untyped_storage()) in self._poisoned:
            return None  # written by an operation with an unknown input, through this tensor or another view
        return real

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if all(self.value(t) is not None for t in tensors) and torch.Tag.nondeterministic_seeded not in func.tags:
            return self._known(func, args, kwargs)
        if not tensors and kwargs.get("generator") is None and torch.Tag.nondeterministic_seeded in func.tags:
            return self._drawn(func, args, kwargs)
        if func in _MASKED:
            args = self._masks_to_indices(func, args)
        args, kwargs = self._autocast(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            out = self._bound(func, args, kwargs)
        self._forget_written(func, args, kwargs)
        return out

    # ---- all inputs known ------------------------------------------------------------------------------------

    def _known(self, func, args, kwargs):
        if any(tag in func.tags for tag in _DATA_DEPENDENT):
            real = _run_real(func, args, kwargs)
            return self._fakes_like(real, _device_of(args, kwargs))
        out = func(*args, **kwargs)
        fakes = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if sum(t.numel() for t in fakes) > LIMIT:
            self._forget_written(func, args, kwargs)
            return out
        real = _run_real(func, args, kwargs)
        _attach(out, real)
        return out

    def _drawn(self, func, args, kwargs):
        """A small random draw from the global generator (a scheduler's seed: ``torch.randint(0, 2**63 - 1, [])
        .item()``) depends on no weight: it is drawn for real, from a copy of the generator's state, so the dry run
        leaves the caller's random state as it found it. Noise the size of latents stays unknown."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.numel() <= DRAWN:
            with torch.random.fork_rng(devices=[]):
                _attach(out, _run_real(func, args, kwargs))
        return out

    def _fakes_like(self, real, device: torch.device):
        """Fakes of ``real``'s shapes on ``device``, carrying ``real``: made through the lower modes, so counted."""
        def fake(value):
            if not isinstance(value, torch.Tensor):
                return value
            made = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            made.__dict__[_ATTR] = value
            return made

        return tree_map(fake, real)

    def _forget_written(self, func, args, kwargs) -> None:
        for tensor in _written(func, args, kwargs):
            if isinstance(tensor, FakeTensor) and real_value(tensor) is not None:
                storage = tensor.untyped_storage()
                if id(storage) not in self._poisoned:
                    self._poisoned.add(id(storage))
                    weakref.finalize(storage, self._poisoned.discard, id(storage))

    # ---- masks, bounds, autocast -----------------------------------------------------------------------------

    def _masks_to_indices(self, func, args):
        """``x[mask]`` with a known mask and an unknown ``x``: the mask's ``nonzero`` indices give the same result
        (as PyTorch expands it); fake mode cannot size a boolean index. An unknown mask is taken as all true."""
        indices = []
        for index in args[1]:
            if index is None or index.dtype not in (torch.bool, torch.uint8):
                indices.append(index)
                continue
            mask = self.value(index)
            if mask is None:
                with _disable_current_modes():
                    mask = torch.ones(index.shape, dtype=torch.bool)
                self._assume(f"{func}: a boolean index computed from weights taken as all true")
            with _disable_current_modes():
                positions = tuple(mask.bool().nonzero().unbind(1))
            positions = self._fakes_like(positions, index.device)
            indices.extend(positions)
        return (args[0], indices, *args[2:])

    def _bound(self, func, args, kwargs):
        """An upper bound for a data-dependent result of unknown inputs, or an error naming the operation."""
        source: Any = args[0] if args else None
        if func is aten.bincount.default and len(args) == 1 and not kwargs.get("weights"):
            with _disable_current_modes():
                counts = torch.zeros(max(1, kwargs.get("minlength", 0)), dtype=torch.int64)
                counts[0] = source.numel()
            self._assume(f"{func}: every entry counted in the first bin (every token routed to one expert)")
            return self._fakes_like(counts, source.device)
        if func is aten.nonzero.default:
            self._assume(f"{func}: every element of a tensor computed from weights taken as nonzero")
            with _disable_current_modes():
                positions = torch.ones(source.shape, dtype=torch.bool).nonzero()
            return self._fakes_like(positions, source.device)
        raise UnknownValueError(str(func))

    def _assume(self, note: str) -> None:
        if note not in self.bounds:
            self.bounds.append(note)
        self.on_bound(note)

    def _autocast(self, func, args, kwargs):
        if not self.autocast or not self.autocast[-1][0] or func not in _AUTOCAST:
            return args, kwargs
        dtype = self.autocast[-1][1]

        def cast(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "meta" and t.dtype != dtype:
                return t.to(dtype)
            return t

        return tree_map(cast, args), tree_map(cast, kwargs)


def _run_real(func, args, kwargs):
    """``func`` on the known values, on the CPU, outside every mode (so nothing counts these bytes)."""
    def real(x):
        if isinstance(x, torch.Tensor):
            return real_value(x)
        if isinstance(x, torch.device) and x.type != "cpu":
            return torch.device("cpu")
        return x

    kwargs = dict(kwargs)
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    kwargs.pop("pin_memory", None)
    with _disable_current_modes():
        return func(*tree_map(real, args), **tree_map(real, kwargs))


def _attach(fake_out, real_out) -> None:
    fakes, spec = tree_flatten(fake_out)
    reals, real_spec = tree_flatten(real_out)
    if spec != real_spec:
        return
    for fake, real in zip(fakes, reals):
        if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor) and fake.shape == real.shape:
            fake.__dict__[_ATTR] = real


def _device_of(args, kwargs) -> torch.device:
    tensors = tensors_in((args, kwargs))
    for tensor in tensors:
        if not (tensor.device.type == "cpu" and tensor.dim() == 0):
            return tensor.device
    return tensors[0].device if tensors else torch.device("cpu")


def _written(func, args, kwargs) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for position, name, kwarg_only in _writes(func):
        value = kwargs.get(name) if kwarg_only or position >= len(args) else args[position]
        out.extend(tensors_in(value))
    return out


_WRITES: dict = {}  # operation -> the arguments it writes (from its schema, read once: most write none)


def _writes(func) -> tuple[tuple[int, str, bool], ...]:
    found = _WRITES.get(func)
    if found is None:
        found = _WRITES[func] = tuple((position, a.name, a.kwarg_only) for position, a in
                                      enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write)
    return found


_READS = (torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__array__)


class KnownReads(TorchFunctionMode):
    """Reads that bypass dispatch: ``.numpy()``, ``.tolist()`` and ``torch.tensor([t / 1000])`` refuse any tensor
    subclass, so a known fake answers them with its real value. And ``copy.deepcopy``, which copies storages on the
    host (``_deepcopy``)."""

    def __init__(self, known: KnownValues):
        super().__init__()
        self.known = known

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__deepcopy__:
            return _deepcopy(*args)
        if func in _READS and isinstance(args[0], FakeTensor):
            real = self.known.value(args[0])
            if real is not None:
                with _disable_current_modes():  # under fake mode, numpy() of a real tensor would read a fake's memory
                    return func(real, *args[1:], **kwargs)
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and args:
            args = (tree_map(self._plain, args[0]), *args[1:])
        return func(*args, **kwargs)

    def _plain(self, value):
        if isinstance(value, FakeTensor):
            real = self.known.value(value)
            if real is not None:
                return real
        return value


def _deepcopy(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
    """``copy.deepcopy`` in the dry run. Pipeline code deep-copies what it holds: a mask (Kandinsky's inpainting), a
    scheduler whose timesteps live on the device (SkyReels' per-frame schedulers). A stand-in's copy is a new
    stand-in of the same size, dtype and device (counted there, its known value kept), as a copy on the GPU would
    be; a host tensor's copy is made on the host, outside every mode (under fake mode its storage copy fails)."""
    if id(tensor) in memo:
        return memo[id(tensor)]
    if not isinstance(tensor, FakeTensor):
        with _disable_current_modes():
            return copy.deepcopy(tensor, memo)
    with torch.no_grad():
        new = tensor.clone()
    if isinstance(tensor, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
    memo[id(tensor)] = new
    return new


@contextlib.contextmanager
def standin_autocast(known: KnownValues, stands_for: str = "cuda"):
    """``torch.autocast(x.device.type, ...)`` with a stand-in's type ("meta") or the type it stands for: push the
    state on ``known``'s autocast stack, which casts matmul and convolution inputs on stand-ins as CUDA would.
    Other device types (the CPU) keep torch's own autocast."""
    class autocast(torch.amp.autocast_mode.autocast):  # noqa: N801  (torch's own name)
        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            self._standin = device_type in ("meta", stands_for)
            if not self._standin:
                super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            self._state = (enabled, dtype if dtype is not None else torch.float16)

        def __enter__(self):
            if not self._standin:
                return super().__enter__()
            known.autocast.append(self._state)
            return self

        def __exit__(self, *exc):
            if not self._standin:
                return super().__exit__(*exc)
            known.autocast.pop()
            return False

    # torch patched on purpose while the dry run lasts; mypy takes no class assigned to a class's name
    saved = (torch.autocast, torch.amp.autocast)
    torch.autocast = torch.amp.autocast = autocast  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = saved  # type: ignore[misc]


@contextlib.contextmanager
def legacy_constructor(known: KnownValues):
    """``torch.Tensor([0.25 * sigma.log() for sigma in sigmas])`` (Euler's continuous timesteps): the legacy
    constructor reads each element in C++, past every mode, so known fakes in its data are swapped for their values
    while the dry run lasts."""
    base = torch._C.TensorBase.__new__

    def new(cls, *args, **kwargs):
        if args and isinstance(args[0], (list, tuple)):
            args = (tree_map(lambda v: known.value(v) if isinstance(v, FakeTensor) and known.value(v) is not None
                             else v, args[0]), *args[1:])
        return base(cls, *args, **kwargs)

    torch.Tensor.__new__ = new  # type: ignore[method-assign]  # patched on purpose while the dry run lasts
    try:
        yield
    finally:
        del torch.Tensor.__new__


@contextlib.contextmanager
def known_values(on_bound: Callable[[str], None] | None = None):
    """Enter last (innermost), after the fake mode and the trackers, so the trackers see what this mode rewrites."""
    known = KnownValues(on_bound)
    with standin_autocast(known), legacy_constructor(known), KnownReads(known), known:
        yield known

