"""The dry run's trackers: live and peak bytes per stand-in device, weights told apart from activations, the phase
of the call (prompt encoding, each denoising step, VAE decode) and the component running when each peak was set.

``StorageTracker`` counts storages (fake tensors cost no memory, so PyTorch's own statistics cannot see them);
``ConvertingTracker`` adds module conversions (``vae.to(torch.float32)``) and ``PhasedTracker`` the phases and
timeline; ``ComponentTracker`` and ``PhaseTracker`` say where the call is, from module hooks.
"""

from __future__ import annotations

import collections
import contextlib
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode

from ..quantized import storage
from .known import tensors_in


class StorageTracker(TorchDispatchMode):
    """Live bytes per device, every storage counted once and freed when it dies; ``peak`` is the high mark.

    Weights are told apart from activations: the module tensors present at ``track_module_tensors``, their copies
    to another device and the buffers offload and stream hooks onload into (``allocating_weights``, which the dry
    run's queues enter: ``queues.StandinQueues``), so
    ``weight_peak`` is the most weight bytes a device held at once and ``activation_peak`` the most of everything
    else. Written for fake tensors, which PyTorch's own ``torch.cuda`` memory statistics cannot see.
    """

    replays = True  # a stretch measured once may be counted again (``window``, ``replay``): a tiled decode's tiles

    def __init__(self):
        super().__init__()
        self.live: collections.Counter = collections.Counter()
        self.peak: collections.Counter = collections.Counter()
        self.weights: collections.Counter = collections.Counter()
        self.weight_live: collections.Counter = collections.Counter()
        self.weight_peak: collections.Counter = collections.Counter()
        self.activation_peak: collections.Counter = collections.Counter()
        self._seen: dict[int, tuple[str, int]] = {}
        self._weight_keys: set[int] = set()
        self.bound: str | None = None  # the first value assumed (an upper bound) in this run
        self._allocating_weights = False
        self.peak_bound: dict[str, str] = {}  # devices whose peak was last raised after it: a bound, not exact
        self._disk_keys: set[int] = set()  # host copies left in their files: counted on "disk", not the CPU
        self._windows: list[dict[str, list[int]]] = []  # open ``window``s: per device, the highs seen inside

    @contextlib.contextmanager
    def allocating_weights(self):
        """What is allocated inside counts as weights (a hook's buffer for onloaded weights)."""
        self._allocating_weights = True
        try:
            yield
        finally:
            self._allocating_weights = False

    def assume(self, note: str) -> None:
        """From here on, sizes may be upper bounds: a peak raised after this is marked as one."""
        self.bound = self.bound or note

    def on_disk(self, tensors) -> None:
        """These host copies stay in their files (the disk tier): count them on ``"disk"`` when first tracked."""
        self._disk_keys.update(id(t.untyped_storage()) for t in tensors)

    def _levels(self, device: str) -> list[int]:
        """What ``window`` and ``replay`` follow on a device: bytes live, activations live, weights live."""
        live, weights = self.live[device], self.weight_live[device]
        return [live, live - weights, weights]

    @contextlib.contextmanager
    def window(self):
        """The most each device held while inside, above what it held on entry: yields a dict filled on exit,
        ``{device: [bytes, activation bytes, weight bytes]}``, what ``replay`` takes."""
        entry = {d: self._levels(d) for d in self.live}
        highs: dict[str, list[int]] = {}
        self._windows.append(highs)
        rises: dict[str, list[int]] = {}
        try:
            yield rises
        finally:
            self._windows.remove(highs)
            for device, high in highs.items():
                start = entry.get(device, [0, 0, 0])
                rises[device] = [max(0, h - s) for h, s in zip(high, start, strict=True)]

    def replay(self, rises: dict[str, list[int]]) -> None:
        """A stretch of the call that held ``rises`` above what each device holds now (a ``window`` measured it),
        and gave it back: the peaks as if it had run again."""
        for device, (rise, activations, weights) in rises.items():
            live, active, weight = self._levels(device)
            self._raise_peak(device, live + rise)
            self.activation_peak[device] = max(self.activation_peak[device], active + activations)
            self.weight_peak[device] = max(self.weight_peak[device], weight + weights)

    def _raise_peak(self, device: str, level: int) -> None:
        """``level`` bytes were live on ``device`` for a moment: the peak, and each open window's high."""
        if level > self.peak[device]:
            self.peak[device] = level
            if self.bound is not None:
                self.peak_bound[device] = self.bound

    def track_module_tensors(self, pipe) -> None:
        for module in _with_replicas(pipe):
            for tensor in (t for w in [*module.parameters(), *module.buffers()] for t in storage(w)):
                if self._track(tensor, weight=True):  # a quantized weight by its storage: the bytes it holds
                    self.weights[self._seen[id(tensor.untyped_storage())][0]] += tensor.untyped_storage().nbytes()

    def _track(self, tensor: torch.Tensor, weight: bool = False) -> bool:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return False
        device, size = "disk" if key in self._disk_keys else str(tensor.device), storage.nbytes()
        self._seen[key] = (device, size)
        self.live[device] += size
        if weight:
            self._weight_keys.add(key)
            self.weight_live[device] += size
            self.weight_peak[device] = max(self.weight_peak[device], self.weight_live[device])
        self._raise_peak(device, self.live[device])
        self.activation_peak[device] = max(self.activation_peak[device],
                                           self.live[device] - self.weight_live[device])
        for highs in self._windows:
            high = highs.setdefault(device, [0, 0, 0])
            high[:] = [max(h, level) for h, level in zip(high, self._levels(device), strict=True)]
        weakref.finalize(storage, self._free, key)
        return True

    def _free(self, key: int) -> None:
        device, size = self._seen.pop(key)
        self.live[device] -= size
        if key in self._weight_keys:
            self._weight_keys.discard(key)
            self.weight_live[device] -= size

    def _onloads_weight(self, func, args, out) -> bool:
        if func is not torch.ops.aten._to_copy.default or not args or not isinstance(out, torch.Tensor):
            return False
        source = args[0]
        return id(source.untyped_storage()) in self._weight_keys and source.device != out.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        weight = self._allocating_weights or self._onloads_weight(func, args, out)
        for tensor in tensors_in(out):
            self._track(tensor, weight)
        return out


def _with_replicas(pipe, only: str | None = None) -> list[torch.nn.Module]:
    """The pipeline's models, each followed by the copies its hook holds (a replicated denoiser's; a sequence
    split's rank 0, a copy on the denoiser's own GPU, then its other ranks' copies held in this process)."""
    found = []
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and only in (None, name):
            hook = getattr(module, "_hf_hook", None)
            home = getattr(hook, "home", None)
            found += [module, *([home] if isinstance(home, torch.nn.Module) else []), *getattr(hook, "replicas", ())]
    return found


class ComponentTracker:
    """Which component is running, from global module hooks: a failure can then name its component."""

    def __init__(self, pipe):
        self._owner = {id(m): name for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)
                       for held in _with_replicas(pipe, name) for m in held.modules()}
        self._stack: list[str] = []
        self._handles = []
        self.current: str | None = None

    def _enter(self, module, *args):
        name = self._owner.get(id(module))
        if name is not None:
            self._stack.append(name)
            self.current = name

    def _leave(self, module, *args):
        if self._owner.get(id(module)) is not None and self._stack:
            self._stack.pop()
            self.current = self._stack[-1] if self._stack else None

    def __enter__(self):
        self._handles = [nn_module.register_module_forward_pre_hook(self._enter),
                         nn_module.register_module_forward_hook(self._leave)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()


class ConvertingTracker(StorageTracker):
    """The storage tracker, told of module conversions: a weight cast to another dtype or device stays a weight up
    to the bytes it had, so an upcast's extra bytes (SDXL's fp32 VAE: twice its fp16 bytes) count as activations,
    the room a plan's headroom must leave, and a cast back costs nothing extra."""

    def __init__(self):
        super().__init__()
        self._weight_size: dict[int, int] = {}

    def converted(self, old: torch.Tensor, new: torch.Tensor) -> None:
        old_key, new_key = id(old.untyped_storage()), id(new.untyped_storage())
        if old_key not in self._weight_keys or new_key not in self._seen or new_key in self._weight_keys:
            return
        device, size = self._seen[new_key]
        portion = min(size, self._weight_size.get(old_key, self._seen[old_key][1]))
        self._weight_keys.add(new_key)
        self._weight_size[new_key] = portion
        self.weight_live[device] += portion
        self.weight_peak[device] = max(self.weight_peak[device], self.weight_live[device])

    def _free(self, key: int) -> None:
        portion = self._weight_size.pop(key, None)
        if portion is not None:  # the base class takes a weight's whole size off; this one counted only its portion
            device, size = self._seen[key]
            self.weight_live[device] += size - portion
        super()._free(key)


@dataclass(frozen=True)
class Phase:
    """A part of the call: ``kind`` is "prompt encoding", "denoising", "VAE decode", ...; ``step`` counts from 1."""

    kind: str
    step: int | None = None

    def __str__(self) -> str:
        return f"{self.kind} (step {self.step})" if self.step else self.kind


class PhaseTracker:
    """Which phase of the call is running, from global module hooks and the scheduler's ``step`` calls.

    A component's modules name their phase: text encoders encode the prompt, a VAE's decoder decodes, anything else
    a model calls during the loop denoises (UNet, transformer, ControlNet); pipeline code between modules belongs to
    the phase last seen.
    """

    def __init__(self, pipe):
        self._kind: dict[int, str] = {}
        for name, component in pipe.components.items():
            if isinstance(component, torch.nn.Module):
                for path, module in component.named_modules():
                    self._kind[id(module)] = _phase_kind(name, path)
        self._depth = 0
        self.steps_done = 0
        self.current = Phase("weights")
        self.on_change: Callable[[Phase], None] | None = None  # told each new phase (a progress bar)

    def _enter(self, module, *args):
        kind = self._kind.get(id(module))
        if kind is None:
            return
        if self._depth == 0 or kind == "VAE decode" or kind == "VAE encode":
            step = self.steps_done + 1 if kind == "denoising" else None
            phase = Phase(kind, step)
            if phase != self.current and self.on_change is not None:
                self.on_change(phase)
            self.current = phase
        self._depth += 1

    def _leave(self, module, *args):
        if id(module) in self._kind:
            self._depth -= 1

    @contextlib.contextmanager
    def watching(self, scheduler):
        previous = scheduler.__dict__.get("step")  # the host scheduler's own wrapper, if any
        scheduler.__dict__["step"] = _CountedStep(self, scheduler, scheduler.step)
        handles = [nn_module.register_module_forward_pre_hook(self._enter),
                   nn_module.register_module_forward_hook(self._leave)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            if previous is None:
                scheduler.__dict__.pop("step", None)
            else:
                scheduler.__dict__["step"] = previous


class _CountedStep:
    """The watched scheduler's ``step``, counting the steps done. A deep copy of the scheduler (SkyReels' one per
    frame) runs its own class's ``step`` on itself, uncounted, instead of this one on the original."""

    def __init__(self, phases: PhaseTracker, scheduler, step):
        self.phases, self.scheduler, self.step = phases, scheduler, step

    def __call__(self, *args, **kwargs):
        result = self.step(*args, **kwargs)
        self.phases.steps_done += 1
        return result

    def __deepcopy__(self, memo):
        copied = memo.get(id(self.scheduler))
        return self if copied is None else types.MethodType(type(self.scheduler).step, copied)


def _phase_kind(component: str, path: str) -> str:
    if "text_encoder" in component:
        return "prompt encoding"
    if "image_encoder" in component:
        return "image encoding"
    if "safety_checker" in component:
        return "safety check"
    if component == "vae" or component.startswith("vae"):
        top = path.split(".")[0]
        if top in ("decoder", "post_quant_conv"):
            return "VAE decode"
        if top in ("encoder", "quant_conv"):
            return "VAE encode"
        return "VAE"
    return "denoising"


class PhasedTracker(ConvertingTracker):
    """The converting tracker that also notes the phase running when each device's peak was set."""

    def __init__(self, phases: PhaseTracker, component: Callable[[], str | None] = lambda: None):
        super().__init__()
        self.phases = phases
        self.component = component  # the component running now (``ComponentTracker.current``)
        self.peak_phase: dict[str, Phase] = {}
        self.peak_component: dict[str, str] = {}
        # the timeline: (device, bytes live, phase) after every allocation and free, in order
        self.samples: list[tuple[str, int, Phase]] = []

    def _track(self, tensor: torch.Tensor, weight: bool = False) -> bool:
        device = "disk" if id(tensor.untyped_storage()) in self._disk_keys else str(tensor.device)
        before = self.peak[device]
        tracked = super()._track(tensor, weight)
        if self.peak[device] > before:
            self.peak_phase[device] = self.phases.current
            self.peak_component[device] = self.component() or ""
        if tracked:
            self.samples.append((device, self.live[device], self.phases.current))
        return tracked

    def _free(self, key: int) -> None:
        device = self._seen[key][0]
        super()._free(key)
        self.samples.append((device, self.live[device], self.phases.current))

    def replay(self, rises: dict[str, list[int]]) -> None:
        for device, (rise, _, _) in rises.items():
            before = self.peak[device]
            super().replay({device: rises[device]})
            if self.peak[device] > before:
                self.peak_phase[device] = self.phases.current
                self.peak_component[device] = self.component() or ""
            self.samples.append((device, self.live[device] + rise, self.phases.current))
