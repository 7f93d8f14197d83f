"""Stand-in devices for the dry run: fake weights on ``meta:N``, and stricter device checks.

What PyTorch's fake mode lacks for a whole-pipeline dry run, each piece here says in its docstring.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import init_empty_weights
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import DeviceMixError, StandInError
from ..inventory.folder import model_entry, read_model_index
from ..inventory.values import kept_fp32
from ..plan import Plan
from ..quantized import is_packed, restored, storage
from ..quiet import quiet_progress
from .known import tensors_in


def devices_for(plan: Plan) -> dict[str, str]:
    """The stand-in of each device of a plan: ``cuda:N`` -> ``meta:N``; the CPU stays the CPU."""
    standins, spare = {}, 64
    for device in [d.device for d in plan.devices] + [p.device for p in plan.components]:
        kind, _, index = device.partition(":")
        if device in standins:
            continue
        if kind in ("cpu", "meta"):
            standins[device] = device
        elif kind == "cuda":
            standins[device] = f"meta:{index}"
        else:
            standins[device], spare = f"meta:{spare}", spare + 1
    return standins


def _fake(tensor: torch.Tensor, mode: FakeTensorMode, device: str, dtype: torch.dtype | None = None):
    if is_packed(tensor):  # a quantized weight: its storage faked, the subclass made again around it (stored size)
        return restored(tensor, [_fake(leaf, mode, device) for leaf in storage(tensor)])
    # as .to(device) copies it: a view into a larger storage (a slice kept as a buffer) arrives as just its elements
    dense = tensor.is_meta or tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    with mode:
        fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()) if dense else
                                   torch.empty(tuple(tensor.shape), device="meta").stride(),
                                   dtype=dtype or tensor.dtype, device=device)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=False)
    return fake


def fake_module(module: torch.nn.Module, mode: FakeTensorMode, device: str) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are fakes on ``device`` (tied weights stay tied).

    ``module.to`` and ``.data =`` refuse fake tensors, so the copy is made by ``deepcopy`` with a memo that maps
    each real tensor to its fake: no weight byte is copied and the original is untouched. Tensors a module keeps
    as plain attributes get fakes too: ``torch.nn.utils.weight_norm`` keeps its computed ``weight`` so, a tensor
    that ``deepcopy`` refuses (not a graph leaf) and that its hook computes again at every call.
    """
    memo: dict[int, object] = {}
    for tensor in list(module.parameters()) + list(module.buffers()) + _attribute_tensors(module):
        if id(tensor) not in memo:
            memo[id(tensor)] = _fake(tensor.detach(), mode, device) if not isinstance(
                tensor, torch.nn.Parameter) else _fake(tensor, mode, device)
    return copy.deepcopy(module, memo)


def _attribute_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [value for sub in module.modules() for value in vars(sub).values() if isinstance(value, torch.Tensor)]


def pipeline_from_folder(folder, plan: Plan, mode: FakeTensorMode, device_of: Mapping[str, str]):
    """A pipeline whose models are built from their configs with fake weights; no weight byte is read.

    The models are built under accelerate's ``init_empty_weights`` and handed to ``DiffusionPipeline
    .from_pretrained``, which then loads only the tokenizers and the scheduler.
    """
    from diffusers import DiffusionPipeline

    folder = Path(folder)
    index = read_model_index(folder)
    dtype = getattr(torch, plan.dtype) if plan.dtype else None
    models = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry:
            continue
        if not (folder / name / "config.json").is_file():
            continue
        try:
            model = _standin_model(folder, name, entry, dtype, mode, device_of.get(name, "cpu"))
        except Exception as err:  # a model class the dry run cannot build: the report names it
            raise StandInError(name, entry[1], err) from err
        if model is not None:
            models[name] = model
    with _passed_models_kept(index.get("_class_name"), models) as pipeline_class:
        try:
            with quiet_progress():  # its "Loading pipeline components" bar: the tokenizers and scheduler only
                pipe = (pipeline_class or DiffusionPipeline).from_pretrained(folder, **models)
        except Exception as err:
            raise StandInError(None, str(index.get("_class_name")), err) from err
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _standin_model(folder: Path, name: str, entry: list, dtype: torch.dtype | None, mode: FakeTensorMode,
                   device: str) -> torch.nn.Module | None:
    """The entry's model built from its config with fake weights at the plan's dtype; None for what has none.

    The folder's facts (class, loader, dtype, kept-fp32 modules) come whole from ``inventory.folder.model_entry``:
    the calls go one way, from the stand-in builder to the inventory."""
    found = model_entry(folder, name, entry[0], entry[1], dtype)
    if found is None:
        return None  # a tokenizer, scheduler or processor: from_pretrained loads it, no weights
    module = _empty_module(folder, name, found.cls, found.library)
    return fill_fakes(module, mode, device, found.dtype, found.keep_fp32, cast_built=dtype is not None)


@contextlib.contextmanager
def _passed_models_kept(class_name, models: Mapping):
    """``from_pretrained`` loads from disk, and keeps, a component whose ``__init__`` argument has a default but
    is not in ``_optional_components`` (HunyuanDiT's ``text_encoder_2``), even when one is passed in: real weights
    read, real tensors in the dry run. Listed as optional for a call on the pipeline's own class (``DiffusionPipeline
    .from_pretrained`` reads its own list), the passed model is used."""
    import diffusers

    cls = getattr(diffusers, str(class_name), None)
    if cls is None:
        yield None
        return
    original = cls.__dict__.get("_optional_components")
    cls._optional_components = list(cls._optional_components) + [n for n in models
                                                                 if n not in cls._optional_components]
    try:
        yield cls
    finally:
        if original is None:
            del cls._optional_components
        else:
            cls._optional_components = original


def _empty_module(folder: Path, name: str, cls: type[Any], library: str) -> torch.nn.Module:
    with init_empty_weights(include_buffers=False):
        if library == "diffusers":
            return cls.from_config(cls.load_config(folder, subfolder=name))
        config = _config_class(cls).from_pretrained(folder / name)
        module = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
    # init_empty_weights makes a new parameter on each assignment, which unties tied weights (T5's shared
    # embedding): tie them again, as a real load leaves them
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module


def _config_class(cls: type):
    """The config class ``cls.from_pretrained`` reads: the model's own (Kolors' ChatGLM, Kandinsky 2.1's M-CLIP live
    in diffusers' pipeline modules, with a ``model_type`` transformers' ``AutoConfig`` does not know), else
    ``AutoConfig``."""
    from transformers import AutoConfig, PretrainedConfig

    own = getattr(cls, "config_class", None)
    return own if isinstance(own, type) and own is not PretrainedConfig else AutoConfig


def fill_fakes(module: torch.nn.Module, mode: FakeTensorMode, device: str, dtype: torch.dtype,
                keep_fp32: tuple[str, ...], cast_built: bool = True) -> torch.nn.Module:
    """Fakes for ``module``'s tensors at ``dtype``; with ``cast_built=False`` (no ``torch_dtype`` given) buffers
    the checkpoint does not hold keep the dtype the model built them in (CogVideoX's float64 positions), as a
    real load leaves them."""
    made: dict[int, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for store in (sub._parameters, sub._buffers):
            for key, tensor in store.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    name = f"{prefix}.{key}" if prefix else key
                    kept = kept_fp32(name, keep_fp32)
                    built = not cast_built and key in sub._non_persistent_buffers_set and store is sub._buffers
                    target = (torch.float32 if kept else dtype) if tensor.is_floating_point() and not built \
                        else tensor.dtype
                    made[id(tensor)] = _fake(tensor, mode, device, target)
                store[key] = made[id(tensor)]
    return module


# ---- checks and measurements -----------------------------------------------------------------------------------

_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten._copy_from.default,
           torch.ops.aten._copy_from_and_resize.default, torch.ops.aten.copy.default}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._unsafe_index.Tensor, torch.ops.aten.index_select.default}


class StrictDevices(TorchDispatchMode):
    """Raise when one operation's tensors span several devices, as CUDA would.

    Fake mode skips its own device check for ``aten.embedding`` and index operations when a tensor is on a meta
    device, so token ids on ``meta:0`` fed to an embedding on ``meta:1`` would pass. 0-dim CPU scalars, copies and
    CPU index tensors are allowed, as they are on GPUs.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _COPIES:
            tensors = tensors_in((args, kwargs))
            devices = {str(t.device) for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if func in _INDEXING or func is torch.ops.aten.embedding.default:
                devices = {d for d in devices if d != "cpu"} or devices
            if len(devices) > 1:
                raise DeviceMixError(str(func), tuple(sorted(devices)))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fused_attention():
    """Model a fused attention kernel on stand-in devices.

    On meta devices ``scaled_dot_product_attention`` decomposes to the math path and materialises the whole score
    matrix (a peak 10x too high); a real GPU runs a fused kernel, whose fake counterpart returns only the output.
    A boolean mask goes to the fused kernel as a GPU's SDPA gives it: turned into an additive mask of the query's
    dtype first (``convert_boolean_attn_mask``), never a materialised score matrix.
    """
    original = F.scaled_dot_product_attention

    # torch's own argument names: diffusers' attention dispatcher passes query=, key=, value= by keyword
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if _standin(query) and not enable_gqa:
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(),
                                                                                        float("-inf"))
            # the kernel takes (batch, heads, tokens, width); a 3-D call (HunyuanImage 2.1's VAE) has one head
            lead = query.shape[:-2]
            q, k, v = (t.reshape(-1, 1, *t.shape[-2:]) if t.dim() != 4 else t for t in (query, key, value))
            mask = attn_mask.reshape(-1, 1, *attn_mask.shape[-2:]) if attn_mask is not None and query.dim() != 4 and \
                attn_mask.dim() >= 2 else attn_mask
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, False, dropout_p, is_causal, scale=scale)[0]
            return out if query.dim() == 4 else out.reshape(*lead, *out.shape[-2:])
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _standin(tensor) -> bool:
    return isinstance(tensor, FakeTensor) and tensor.device.type == "meta"


@contextlib.contextmanager
def attention_kernels():
    """Attention kernels that refuse a stand-in device answer as on the GPU it stands for.

    FlexAttention (AnyFlow's block masks, ``set_attention_backend("flex")``) accepts CUDA and CPU tensors only,
    diffusers' flash, sage and xformers backends check ``device.type == "cuda"``: on a stand-in each such kernel
    returns what the fused GPU kernel would, its output alone (after the same device check), and the backends'
    device-type checks read the stand-in as CUDA. PyTorch's own scaled dot product is ``fused_attention``'s.
    """
    from diffusers.models import attention_dispatch as dispatch
    from torch.nn.attention import flex_attention as flex

    registry = dispatch._AttentionBackendRegistry
    kept = (dict(registry._backends), {k: list(v) for k, v in registry._constraints.items()}, flex.flex_attention)
    native = {dispatch.AttentionBackendName.NATIVE, dispatch.AttentionBackendName._NATIVE_MATH}
    for name, function in kept[0].items():
        if name not in native:
            registry._backends[name] = _fused_backend(function)
        registry._constraints[name] = [_cuda_check(check) for check in kept[1][name]]
    flex.flex_attention = _fused_flex(kept[2])
    try:
        yield
    finally:
        registry._backends.clear()
        registry._backends.update(kept[0])
        registry._constraints.update(kept[1])
        flex.flex_attention = kept[2]


def _fused_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A fused attention kernel's output: the query's shape with the value's width, on their one device."""
    devices = tuple(sorted({str(t.device) for t in (query, key, value)}))
    if len(devices) > 1:
        raise DeviceMixError("attention", devices)
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _fused_backend(function):
    """A diffusers attention backend ((batch, tokens, heads, width) in and out) that, on stand-ins, returns the
    fused kernel's output, and its log-sum-exp (batch, tokens, heads) when asked."""

    @functools.wraps(function)
    def backend(query, key, value, *args, **kwargs):
        if not _standin(query):
            return function(query, key, value, *args, **kwargs)
        out = _fused_output(query, key, value)
        if kwargs.get("return_lse"):
            return out, query.new_empty(query.shape[:-1], dtype=torch.float32)
        return out

    return backend


def _fused_flex(function):
    """``flex_attention`` ((batch, heads, tokens, width)) that, on stand-ins, returns the fused kernel's output (and
    its log-sum-exp when asked: ``return_lse`` or ``return_aux``)."""
    def flex_attention(query, key, value, *args, **kwargs):
        if not _standin(query):
            return function(query, key, value, *args, **kwargs)
        out = _fused_output(query, key, value)
        if kwargs.get("return_lse") or kwargs.get("return_aux") is not None:
            return out, query.new_empty(query.shape[:-1], dtype=torch.float32)
        return out

    return flex_attention


def _cuda_check(check):
    """A backend's constraint that, on stand-ins, reads the device type as CUDA (the device a stand-in stands for):
    ``_check_device_cuda`` keeps its same-device and dtype checks, the compute capability is not known."""
    if "device_cuda" not in getattr(check, "__qualname__", ""):
        return check

    def standin_check(query, key, value, **kwargs):
        if not _standin(query):
            return check(query=query, key=key, value=value, **kwargs)
        from diffusers.models.attention_dispatch import _check_device

        return _check_device(query, key, value)

    return standin_check


@contextlib.contextmanager
def standin_generators():
    """``torch.Generator(device)`` for a stand-in device gives a CPU generator.

    Code that seeds a generator on its tensors' device (torchsde's Brownian interval under Stable Audio's
    scheduler: ``torch.Generator(x.device)``) would get one on the GPU; PyTorch has none for ``meta``. Fake random
    tensors take their shape from the call, so a CPU generator serves. ``isinstance(g, torch.Generator)`` keeps
    holding for every generator, the caller's included.
    """
    base: Any = torch.Generator

    class _Kind(type(base)):  # type: ignore[misc]
        def __instancecheck__(cls, obj):
            return isinstance(obj, base)

    class Generator(base, metaclass=_Kind):
        def __new__(cls, device="cpu"):
            return base.__new__(cls, "cpu" if torch.device(device).type == "meta" else device)

        def __init__(self, device="cpu"):
            pass

    torch.Generator = Generator  # type: ignore[misc]
    try:
        yield
    finally:
        torch.Generator = base  # type: ignore[misc]
