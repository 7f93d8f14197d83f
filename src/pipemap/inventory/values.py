"""The planner's values: a pipeline's components (``Component``, ``Inventory``) and the dtypes they are sized at.

No file is read and no module walked here: ``folder`` and ``live`` make these values, the planner reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from ..errors import ArgumentConflictError, UnknownDtypeError
from ..granularity import Block

# Nominal calls per image of a denoiser: 50 steps, twice each under classifier-free guidance. Every other model (text
# encoders, VAE, image encoders) runs once per image; back-to-back calls (a prompt and its negative) need one onload.
DENOISER_CALLS = 100
# the components that run at every step; the first of them present is the pipeline's execution device
DENOISERS = ("transformer", "unet", "prior", "decoder", "transformer_2")
PER_STEP = (*DENOISERS, "controlnet")


@dataclass(frozen=True)
class Component:
    """One entry of a pipeline: a model with weights (``bytes`` > 0) or a weightless part (tokenizer, scheduler)."""

    name: str
    library: str | None
    class_name: str | None
    bytes: int = 0
    has_weights: bool = False
    calls_per_image: int = 0  # 0: from the profile by name (``profile_calls``)
    in_flight: int = 0  # GPU bytes while it runs streamed (``streams.stream_charge``); 0: unknown
    # the repeated blocks a split may cut between, in order: ((module path, bytes), ...); the rest stays whole
    blocks: tuple[tuple[str, int], ...] = ()
    # its modules as a tree (``Block``): what streaming may move as one piece, down to leaf modules; None: unknown
    tree: Block | None = field(default=None, repr=False)
    # weight width summed over its self-attention layers (a transformer's): the cost model's attention FLOPs
    attention_width: int = 0
    # the safetensors files its weights can stay in, memory-mapped (paths below the pipeline folder; absolute for a
    # loaded pipeline's maps): only when every tensor is stored at the dtype it will have, so loading maps it and
    # converts nothing. Empty: its host copy must be RAM (``tiers``)
    files: tuple[str, ...] = ()
    # a transformer's attention heads (its config's ``num_attention_heads``; 0: unknown): a sequence split gives
    # each GPU a share of them, so it is planned only on GPU counts that divide them
    heads: int = 0
    # per weights file: (path below the pipeline folder, the byte its header places its tensors up to), read with the
    # headers that size it, so ``load`` checks the files hold their bytes without reading a header twice
    ends: tuple[tuple[str, int], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not self.calls_per_image:
            object.__setattr__(self, "calls_per_image", profile_calls(self.name))


def profile_calls(name: str) -> int:
    """Nominal calls per image of a component named ``name``: a denoiser every step, anything else once."""
    return DENOISER_CALLS if name in PER_STEP else 1


@dataclass(frozen=True)
class Inventory:
    """A pipeline's components, sized at the dtype they will be loaded in.

    >>> inv = inventory_of("path/to/sdxl")                     # doctest: +SKIP
    >>> {c.name: c.bytes for c in inv.models}             # doctest: +SKIP
    {'text_encoder': 492265168, 'text_encoder_2': 2778702264, 'unet': 10270077736, 'vae': 334643268}
    """

    source: str
    pipeline_class: str
    components: tuple[Component, ...]
    dtype: str | None = None
    variant: str | None = None

    @property
    def models(self) -> tuple[Component, ...]:
        """The components that have weights, in pipeline order."""
        return tuple(c for c in self.components if c.has_weights)

    def __contains__(self, name: object) -> bool:
        return any(c.name == name for c in self.components)

    def __getitem__(self, name: str) -> Component:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(name)


def resolve_dtype(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The one dtype asked for: ``dtype`` (diffusers 0.42, transformers 5) or its older name ``torch_dtype``."""
    dtype, torch_dtype = as_dtype(dtype), as_dtype(torch_dtype)
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ArgumentConflictError("dtype", dtype, "torch_dtype", torch_dtype)
    return dtype if dtype is not None else torch_dtype


@overload
def as_dtype(value: None) -> None:
    ...


@overload
def as_dtype(value: torch.dtype | str) -> torch.dtype:
    ...


@overload
def as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    ...


def as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None:
        return value
    candidate: torch.dtype | None
    if isinstance(value, torch.dtype):
        candidate = value
    elif isinstance(value, str):
        candidate = getattr(torch, value.strip().removeprefix("torch."), None)
        if not isinstance(candidate, torch.dtype):
            raise UnknownDtypeError(value)
    else:
        raise UnknownDtypeError(value, f"a {type(value).__name__} is not a dtype")
    if not candidate.is_floating_point or candidate.itemsize < 2:  # int, bool, complex, fp8: weights don't load so
        raise UnknownDtypeError(value, "pipemap loads weights in a floating dtype of 16 bits or more")
    return candidate


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def kept_fp32(key: str, keep_fp32: Iterable[str]) -> bool:
    """Whether the tensor named ``key`` lies in one of the kept-fp32 modules (matched by whole name parts, as
    diffusers' loader does)."""
    parts = key.split(".")
    return any(m in parts for m in keep_fp32)


def heads_of(config: Any) -> int:
    """A transformer's attention heads from its config (``num_attention_heads``); 0: unknown or none."""
    heads = config.get("num_attention_heads") if isinstance(config, Mapping) else None
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else 0
