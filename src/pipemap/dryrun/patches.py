"""What a dry run patches around a pipeline's own call, so pipeline code treats stand-in weights as a real run
would: module conversions (``vae.to(torch.float32)``), tensor outputs for any ``output_type``, host copies, the
safety checker.

``standin`` makes the weights fake; ``trackers`` count what the call holds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import Counter

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from . import known
from .trackers import ConvertingTracker, StorageTracker

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

    # torch patched on purpose while the dry run lasts
    torch.nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]


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


# ---- outputs ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tensor_outputs():
    """Decoded stand-in images and videos reach pipeline code as the host types it asked for, blank.

    ``postprocess(..., output_type="pil" or "np")`` ends in ``.numpy()``, which a fake cannot give. The decoded
    tensor and its denormalisation are what take device memory, so they run as ``"pt"``; what comes back is what
    the host conversion would give, of the same sizes and blank: PIL images (pipeline code reads ``.size``,
    ``.crop``: VisualCloze cuts its grid of outputs apart) or zero arrays.
    """
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.video_processor import VideoProcessor

    patched = [(VaeImageProcessor, "postprocess", False), (VideoProcessor, "postprocess_video", True)]
    originals = [getattr(cls, name) for cls, name, _ in patched]
    for (cls, name, video), original in zip(patched, originals):
        setattr(cls, name, _as_tensors(original, video))
    try:
        yield
    finally:
        for (cls, name, _), original in zip(patched, originals):
            setattr(cls, name, original)


def _as_tensors(original, video: bool):
    signature = inspect.signature(original)
    data = list(signature.parameters)[1]  # image or video, passed by position or by name

    def postprocess(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        wanted = bound.arguments["output_type"]
        if not isinstance(bound.arguments[data], FakeTensor) or wanted not in ("pil", "np"):
            return original(*bound.args, **bound.kwargs)
        bound.arguments["output_type"] = "pt"
        return _host_like(original(*bound.args, **bound.kwargs), wanted, video)

    return functools.wraps(original)(postprocess)


def _host_like(decoded: torch.Tensor, output_type: str, video: bool):
    """Blank host outputs of ``decoded``'s sizes: (batch, [frames,] channels, height, width) as postprocess gives
    them for ``"pt"``, turned into what it gives for ``"np"`` (channels last) or ``"pil"``."""
    from PIL import Image

    *lead, channels, height, width = decoded.shape
    if output_type == "np":
        return np.zeros((*lead, height, width, channels), dtype=np.float32)
    mode = "L" if channels == 1 else "RGB"
    if not video:
        return [Image.new(mode, (width, height)) for _ in range(lead[0])]
    return [[Image.new(mode, (width, height)) for _ in range(lead[1])] for _ in range(lead[0])]


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

    # torch types a submodule reached by attribute as Tensor | Module, so mypy sees a Tensor called
    def forward(clip_input, images):
        pooled = checker.vision_model(clip_input)[1]  # type: ignore[operator]
        checker.visual_projection(pooled)  # type: ignore[operator]
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


@contextlib.contextmanager
def host_copies():
    """``.numpy()`` of a stand-in (a value computed from weights, which no dry run knows) reads as zeros.

    Pipeline code copies model outputs to the host for checks that do not change device memory: the safety
    checker's scores (``.cpu().float().numpy()``), an image processor reading a decoded image. A read-only
    broadcast of one zero has the right shape and dtype and costs no memory. Decoded outputs never get here
    (``tensor_outputs`` keeps them tensors).
    """

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

    # torch patched on purpose while the dry run lasts
    torch.Tensor.numpy = numpy  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.numpy = original  # type: ignore[method-assign]


# ---- tiles ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def repeated_tiles(vae, tracker: StorageTracker):
    """A tiled VAE runs once what each tile repeats.

    ``enable_tiling()`` decodes a large latent tile by tile: about 1800 tiles at 1024x1024 on a tiny VAE, each
    through the decoder and two blends under fake mode and the trackers (hundreds of seconds, for a figure a few
    tiles set). A call of one of its submodules or its ``blend_*`` methods that repeats an earlier one's arguments
    (the same shapes, strides, dtypes and devices, the same plain values) is not run again: the tracker counts
    again the most the first one held above its start on each device (``StorageTracker.window``, ``replay``),
    and its output is made anew, as the first one's (a fresh tensor of its sizes, or the input it changed in
    place). Fake tensors hold no values, so a dry run's peaks are exactly those of running every tile.
    A call taking anything else (a list of cached frames: a video VAE's decoder) runs as it is.
    """
    if vae is None or not getattr(vae, "use_tiling", False) or not tracker.replays:
        yield
        return
    targets = [(child, "forward") for child in vae.children()]
    targets += [(vae, name) for name in dir(type(vae)) if name.startswith("blend_")]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name in targets]
    for owner, name in targets:
        setattr(owner, name, _once(getattr(owner, name), tracker))
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _once(call, tracker: StorageTracker):
    """``call``, run once per signature of its arguments (``repeated_tiles``). A list argument the call fills (a
    video VAE's cache of each convolution's last frames, Wan's ``feat_cache`` and ``feat_idx``) is filled again by
    a replay as the first call filled it: new tensors of the sizes it put there, the plain values it set."""
    seen: dict[tuple, tuple] = {}

    def run(*args, **kwargs):
        key = _signature((args, sorted(kwargs.items())))
        lists = [a for a in (*args, *kwargs.values()) if type(a) is list]
        if key is not None and key in seen:
            rises, made, filled = seen[key]
            tracker.replay(rises)
            first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            _refill(lists, filled, first)
            if isinstance(made, int):
                return args[made]
            # made from an input, whose value is unknown: a factory call with no tensor input reads as a known value
            shape, stride, dtype, device = made
            return first.new_empty_strided(shape, stride, dtype=dtype, device=device)
        before = [list(items) for items in lists]
        with tracker.window() as rises:
            out = call(*args, **kwargs)
        made = _made(out, args)
        filled = _filled(lists, before, (*args, *kwargs.values(), out))
        if key is not None and made is not None and filled is not None:
            seen[key] = (rises, made, filled)
        return out

    return functools.wraps(call)(run)


def _filled(lists: list[list], before: list[list], tensors: tuple) -> list | None:
    """What a call put in its list arguments, per list and index: a new tensor's sizes, strides, dtype and device,
    or a plain value; None when a replay could not do the same (a list changed length, a view of an input kept)."""
    inputs = {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}
    changes = []
    for items, old in zip(lists, before, strict=True):
        if len(items) != len(old):
            return None
        change = []
        for index, (now, was) in enumerate(zip(items, old, strict=True)):
            if now is was:
                continue
            if isinstance(now, torch.Tensor):
                if now.untyped_storage()._cdata in inputs:
                    return None
                change.append((index, True, (tuple(now.shape), now.stride(), now.dtype, now.device)))
            elif _signature(now) is not None and not isinstance(now, (list, tuple)):
                change.append((index, False, now))
            else:
                return None
        changes.append(change)
    return changes


def _refill(lists: list[list], filled: list, first: torch.Tensor) -> None:
    """Each list as the first call left it: one new tensor at a time, each replacing (and freeing) the old one."""
    for items, change in zip(lists, filled, strict=True):
        for index, is_tensor, value in change:
            if is_tensor:
                shape, stride, dtype, device = value
                items[index] = first.new_empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                items[index] = value


def _signature(value) -> tuple | None:
    """What a call's output and memory depend on under fake tensors, or None: a value of another kind."""
    if isinstance(value, torch.Tensor):
        # not its storage offset: a tile is a view of the latents at another offset, and memory does not depend on it
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, str(value.device))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return ("value", type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        parts = [_signature(v) for v in value]
        return None if any(p is None for p in parts) else ("seq", *parts)
    return None


def _made(out, args: tuple):
    """How a replay makes ``out``: the index of the argument it is (changed in place), or its tensor's sizes,
    strides, dtype and device (a new tensor); None when it is neither (a view of an input, not a tensor)."""
    if not isinstance(out, torch.Tensor) or not any(isinstance(a, torch.Tensor) for a in args):
        return None
    for i, arg in enumerate(args):
        if arg is out:
            return i
    if any(isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == out.untyped_storage()._cdata for a in args):
        return None
    return (tuple(out.shape), out.stride(), out.dtype, out.device)


# ---- the disk tier's staging ring ----------------------------------------------------------------------------------


@contextlib.contextmanager
def staged_copies():
    """The disk tier's staging ring moves no bytes between stand-ins that hold no known values.

    ``hooks.mapped.Staging`` copies a group read from its file into a host slot tensor by tensor (three views of
    each master, then a slice of the slot, a slice of the master and a copy per overlap): six operations a tensor
    that allocate nothing on fake tensors, yet each passes every mode of the dry run (a 14B transformer streamed
    from the disk: thousands a step, most of Wan 2.1's dry run). They are skipped where they change nothing: a
    slot without a known value (``known``: a 64 MiB slot is above its limit) filled from fake masters. A small slot
    keeps its known value and is filled as before, so known buffers (CLIP's ``position_ids``) reach the device. The
    slots, the chunks' copies onto the device and their events run as before: every figure is the same. A master
    that is not contiguous still takes the reshape that copies it (a host allocation the trackers count).
    """
    from ..hooks import mapped

    fill, bytes_of = mapped._fill, mapped._bytes_of

    def standin_bytes(tensor: torch.Tensor) -> torch.Tensor:
        # viewed as bytes only when filled (below): the count of its bytes is the contiguous master's own
        return tensor if isinstance(tensor, FakeTensor) and tensor.is_contiguous() else bytes_of(tensor)

    def standin_fill(slot: torch.Tensor, start: int, end: int, sources) -> list[tuple[int, int]]:
        if known.real_value(slot) is None and all(isinstance(data, FakeTensor) for _, data in sources):
            return []  # copies into an unknown fake: no bytes, no allocation, no address read (``ram.address``)
        return fill(slot, start, end, [(offset, bytes_of(data) if isinstance(data, FakeTensor) else data)
                                       for offset, data in sources])

    mapped._fill, mapped._bytes_of = standin_fill, standin_bytes
    try:
        yield
    finally:
        mapped._fill, mapped._bytes_of = fill, bytes_of
