"""What a dry run adds around a pipeline's own call: module conversions on stand-in weights, tensor outputs, phases.

``standin`` makes the weights fake; this module lets pipeline code treat those weights as a real run would
(``vae.to(torch.float32)``, ``output_type="pil"``) and says which phase of the call set each device's peak.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from . import known, standin

# ---- module conversions ----------------------------------------------------------------------------------------

_local = threading.local()


@contextlib.contextmanager
def module_conversions(tracker: ConvertingTracker | None = None):
    """Let ``module.to(dtype)``, ``.to(device)``, ``.float()`` and ``.half()`` work on stand-in weights.

    ``Module._apply`` swaps a fake parameter in place with ``torch.utils.swap_tensors``, which refuses a tensor
    that fake mode holds a weak reference to; here a module with fake tensors gets new tensors put in its
    ``_parameters`` and ``_buffers`` instead (the path ``_apply`` takes for real tensors of another type), each old
    tensor dropped as soon as its copy is made, as ``param.data = ...`` frees it on a GPU. Tied tensors stay tied.
    """
    original = torch.nn.Module._apply

    def _apply(module, fn, recurse=True):
        if not _has_fakes(module):
            return original(module, fn, recurse)
        outermost = getattr(_local, "conversion", None) is None
        if outermost:
            _local.conversion = {"memo": {}, "shared": _shared_tensors(module)}
        try:
            return _apply_fake(module, fn, recurse, _local.conversion, tracker)
        finally:
            if outermost:
                _local.conversion = None

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original


def _has_fakes(module: torch.nn.Module) -> bool:
    return any(isinstance(t, FakeTensor) for t in _own_tensors(module))


def _own_tensors(module: torch.nn.Module):
    for store in (module._parameters, module._buffers):
        yield from (t for t in store.values() if t is not None)
    for child in module.children():
        yield from _own_tensors(child)


def _shared_tensors(module: torch.nn.Module) -> set[int]:
    counts = Counter(id(t) for t in _own_tensors(module))
    return {key for key, n in counts.items() if n > 1}


def _apply_fake(module: torch.nn.Module, fn, recurse: bool, state: dict, tracker) -> torch.nn.Module:
    if recurse:
        for child in module.children():
            child._apply(fn)
    for store in (module._parameters, module._buffers):
        for key, tensor in list(store.items()):
            if tensor is None:
                continue
            new = state["memo"].get(id(tensor))
            if new is None:
                with torch.no_grad():
                    new = fn(tensor)
                if isinstance(tensor, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
                if tracker is not None:
                    tracker.converted(tensor, new)
                if id(tensor) in state["shared"]:  # kept until the outermost call ends, so its id is not reused
                    state["memo"][id(tensor)] = new
                    state.setdefault("keep", []).append(tensor)
            store[key] = new
    return module


class ConvertingTracker(standin.StorageTracker):
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


# ---- outputs ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tensor_outputs():
    """Decoded stand-in images and videos stay tensors whatever ``output_type`` asks for.

    ``postprocess(..., output_type="pil" or "np")`` ends in ``.numpy()``, which a fake cannot give; the decoded tensor
    and its denormalisation are what take device memory, so they run as ``"pt"`` and the host conversion is skipped.
    """
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.video_processor import VideoProcessor

    patched = [(VaeImageProcessor, "postprocess"), (VideoProcessor, "postprocess_video")]
    originals = [getattr(cls, name) for cls, name in patched]
    for (cls, name), original in zip(patched, originals):
        setattr(cls, name, _as_tensors(original))
    try:
        yield
    finally:
        for (cls, name), original in zip(patched, originals):
            setattr(cls, name, original)


def _as_tensors(original):
    signature = inspect.signature(original)
    data = list(signature.parameters)[1]  # image or video, passed by position or by name

    def postprocess(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if isinstance(bound.arguments[data], FakeTensor) and bound.arguments["output_type"] in ("pil", "np"):
            bound.arguments["output_type"] = "pt"
        return original(*bound.args, **bound.kwargs)

    return functools.wraps(original)(postprocess)


@contextlib.contextmanager
def safety_checks(pipe):
    """The safety checker runs its vision model (its device memory) and passes every image.

    Its verdict compares CLIP embeddings with thresholds stored as weights (``special_care_embeds_weights[i]
    .item()``), values no dry run can know; the images it returns are the ones it was given.
    """
    checker = getattr(pipe, "safety_checker", None)
    if not isinstance(checker, torch.nn.Module) or not hasattr(checker, "vision_model"):
        yield
        return

    def forward(clip_input, images):
        pooled = checker.vision_model(clip_input)[1]
        checker.visual_projection(pooled)
        return images, [False] * len(images)

    # under a dispatch hook, forward is the hook's wrapper and the model's own forward is _old_forward
    name = "_old_forward" if "_old_forward" in checker.__dict__ else "forward"
    original = checker.__dict__.get(name)
    setattr(checker, name, forward)
    try:
        yield
    finally:
        if original is None:
            delattr(checker, name)
        else:
            setattr(checker, name, original)


# ---- phases -----------------------------------------------------------------------------------------------------


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

    def _enter(self, module, *args):
        kind = self._kind.get(id(module))
        if kind is None:
            return
        if self._depth == 0 or kind == "VAE decode" or kind == "VAE encode":
            step = self.steps_done + 1 if kind == "denoising" else None
            self.current = Phase(kind, step)
        self._depth += 1

    def _leave(self, module, *args):
        if id(module) in self._kind:
            self._depth -= 1

    @contextlib.contextmanager
    def watching(self, scheduler):
        from torch.nn.modules import module as nn_module

        previous = scheduler.__dict__.get("step")  # the host scheduler's own wrapper, if any
        step = scheduler.step

        def counted(*args, **kwargs):
            result = step(*args, **kwargs)
            self.steps_done += 1
            return result

        scheduler.__dict__["step"] = counted
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
        self.component = component  # the component running now (``standin.ComponentTracker.current``)
        self.peak_phase: dict[str, Phase] = {}
        self.peak_component: dict[str, str] = {}
        # the timeline: (device, bytes live, phase) after every allocation and free, in order
        self.samples: list[tuple[str, int, Phase]] = []

    def _track(self, tensor: torch.Tensor, weight: bool = False) -> bool:
        device = str(tensor.device)
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


@contextlib.contextmanager
def host_copies():
    """``.numpy()`` of a stand-in (a value computed from weights, which no dry run knows) reads as zeros.

    Pipeline code copies model outputs to the host for checks that do not change device memory: the safety
    checker's scores (``.cpu().float().numpy()``), an image processor reading a decoded image. A read-only
    broadcast of one zero has the right shape and dtype and costs no memory. Decoded outputs never get here
    (``tensor_outputs`` keeps them tensors).
    """
    import numpy as np

    original = torch.Tensor.numpy

    def numpy(self, *args, **kwargs):
        if not isinstance(self, FakeTensor):
            return original(self, *args, **kwargs)
        real = known.real_value(self)  # a known value answers for itself
        with unset_fake_temporarily():
            if real is not None:
                return original(real, *args, **kwargs)
            zero = original(torch.zeros((), dtype=self.dtype))
        return np.broadcast_to(zero, tuple(self.shape))

    torch.Tensor.numpy = numpy
    try:
        yield
    finally:
        torch.Tensor.numpy = original
