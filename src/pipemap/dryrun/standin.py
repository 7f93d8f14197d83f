"""Stand-in devices for the dry run: fake weights on ``meta:N``, and stricter device checks.

What PyTorch's fake mode lacks for a whole-pipeline dry run, each piece here says in its docstring.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import init_empty_weights
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import PipemapError
from ..inventory import component_class, default_dtype, keep_in_fp32, kept_fp32, read_model_index
from ..plan import Plan
from ..quantized import is_packed, restored, storage


class DeviceMixError(PipemapError, RuntimeError):
    """One operation got tensors on several devices, as a real multi-GPU run would fail."""

    def __init__(self, operation: str, devices: tuple[str, ...]):
        self.operation, self.devices = operation, devices
        super().__init__(f"{operation} got tensors on {', '.join(devices)}")


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
    each real tensor to its fake: no weight byte is copied and the original is untouched.
    """
    memo: dict[int, object] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) not in memo:
            memo[id(tensor)] = _fake(tensor, mode, device)
    return copy.deepcopy(module, memo)


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
        cls, library = _model_class(folder, name, *entry)
        if cls is None:
            continue  # a tokenizer, scheduler or processor: from_pretrained loads it, no weights
        class_name = entry[1]
        module = _empty_module(folder, name, cls, library)
        at = dtype if dtype is not None else default_dtype(folder / name, library)
        models[name] = fill_fakes(module, mode, device_of.get(name, "cpu"), at,
                                   keep_in_fp32(library, class_name, at), cast_built=dtype is not None)
    with _passed_models_kept(index.get("_class_name"), models) as pipeline_class:
        pipe = (pipeline_class or DiffusionPipeline).from_pretrained(folder, **models)
    pipe.set_progress_bar_config(disable=True)
    return pipe


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


def _model_class(folder: Path, name: str, library: str, class_name: str) -> tuple[type | None, str]:
    """The model class an entry names, as diffusers resolves it (a pipeline module's model too: Shap-E's renderer,
    DeepFloyd IF's watermarker), and the library whose loader builds it; ``None`` for what has no weights."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    try:
        cls = component_class(library, class_name, folder, name)
    except (ImportError, AttributeError, ValueError):
        return None, library
    if isinstance(cls, type) and issubclass(cls, ModelMixin):
        return cls, "diffusers"
    if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
        return cls, "transformers"
    return None, library


def _empty_module(folder: Path, name: str, cls: type[Any], library: str) -> torch.nn.Module:
    with init_empty_weights(include_buffers=False):
        if library == "diffusers":
            return cls.from_config(cls.load_config(folder, subfolder=name))
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder / name)
        module = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
    # init_empty_weights makes a new parameter on each assignment, which unties tied weights (T5's shared
    # embedding): tie them again, as a real load leaves them
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module


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
            tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
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
    """
    original = F.scaled_dot_product_attention

    # torch's own argument names: diffusers' attention dispatcher passes query=, key=, value= by keyword
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if isinstance(query, FakeTensor) and query.device.type == "meta" and not enable_gqa and (
                attn_mask is None or attn_mask.dtype != torch.bool):
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, False, dropout_p, is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
