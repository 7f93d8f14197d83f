"""What a pipeline is made of, and how many bytes each component will take on its device.

From a folder nothing but ``model_index.json`` and the safetensors headers is read; from a loaded pipeline the
sizes come from its modules. Either way the bytes are those of the dtype the component will have once loaded.

The wing by audience: ``values`` (the planner's ``Component`` and ``Inventory``, dtypes), ``trees`` (a component's
module tree from tensor names and bytes), ``files`` (safetensors files and headers), ``folder`` (facts about a
checkpoint folder: ``model_index.json``, classes, dtypes, checks), ``live`` (walking live modules); here
``inventory_of``, which chooses between a folder and a loaded pipeline. The modules import one another downwards
(values, trees <- files <- folder <- live), never this package, and the public names stay importable from here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import ArgumentTypeError, NotAPipelineError
from .files import check_weights_present, read_header, weight_files
from .folder import (
    check_entry,
    check_variant,
    component_class,
    default_dtype,
    keep_in_fp32,
    loaded_from_folder,
    of_folder,
    read_model_index,
)
from .live import (
    UNMAPPED_SHARE,
    live_blocks,
    live_component,
    mapped_files,
    module_bytes,
    near_submodules,
    of_pipeline,
    stream_blocks,
    submodules,
    tensor_sizes,
)
from .trees import attention_width, block_key, block_tree, split_blocks, streamed_bytes
from .values import (
    DENOISER_CALLS,
    DENOISERS,
    PER_STEP,
    Component,
    Inventory,
    as_dtype,
    kept_fp32,
    profile_calls,
    resolve_dtype,
)

__all__ = [
    "DENOISERS", "DENOISER_CALLS", "PER_STEP", "UNMAPPED_SHARE", "Component", "Inventory", "as_dtype",
    "attention_width", "block_key", "block_tree", "check_entry", "check_variant", "check_weights_present",
    "component_class", "default_dtype", "inventory_of", "keep_in_fp32", "kept_fp32", "live_blocks", "live_component",
    "loaded_from_folder", "mapped_files", "module_bytes", "near_submodules", "profile_calls", "read_header",
    "read_model_index", "resolve_dtype", "split_blocks", "stream_blocks", "streamed_bytes", "submodules",
    "tensor_sizes", "weight_files",
]


def inventory_of(source: object, dtype: torch.dtype | str | None = None, variant: str | None = None, *,
                 torch_dtype: torch.dtype | str | None = None) -> Inventory:
    """The components of a pipeline folder (headers only, no weight read) or of a loaded pipeline.

    >>> inv = pipemap.inspect("path/to/sdxl", dtype=torch.float16, variant="fp16")   # doctest: +SKIP
    >>> [(c.name, c.bytes) for c in inv.models]                                      # doctest: +SKIP
    """
    target = resolve_dtype(dtype, torch_dtype)
    if variant is not None and not isinstance(variant, str):
        raise ArgumentTypeError("variant", variant, "a string such as 'fp16', or None")
    if isinstance(source, Inventory):
        return source
    if isinstance(source, (str, os.PathLike)):
        return of_folder(Path(source), target, variant)
    if hasattr(source, "components") and hasattr(source, "config"):
        return of_pipeline(source, target)
    raise NotAPipelineError(repr(source), "expected a folder path, an Inventory or a loaded DiffusionPipeline")
