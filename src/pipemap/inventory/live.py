"""Walking live modules (or ones built on the meta device): their tensors' bytes, their submodules, the blocks
streaming moves them by, the file maps their weights sit in, and a loaded pipeline's components sized from them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

from ..granularity import finest_in_flight
from ..quantized import is_packed, stored_bytes
from ..ram import address, file_maps
from .folder import keep_in_fp32
from .trees import attention_width, block_tree, split_blocks
from .values import Component, Inventory, dtype_name, heads_of, kept_fp32

# Modules whose children are the blocks a streamed component is moved by: a list's own hook never fires.
_LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def of_pipeline(pipe: Any, dtype: torch.dtype | None) -> Inventory:
    """A loaded pipeline's components, each model sized from its live module at ``dtype``."""
    components = []
    for name, value in pipe.components.items():
        if isinstance(value, torch.nn.Module):
            components.append(live_component(name, value, dtype))
        else:
            components.append(Component(name, *_origin(value)))
    source = str(getattr(pipe.config, "_name_or_path", "") or type(pipe).__name__)
    return Inventory(source, type(pipe).__name__, tuple(components), dtype_name(dtype), None)


def live_component(name: str, module: torch.nn.Module, dtype: torch.dtype | None = None,
                   library: str | None = None, class_name: str | None = None) -> Component:
    """A component sized from a live module (or one built on the meta device): its bytes, bytes in flight when
    streamed, and blocks, at ``dtype`` if given (the model class's kept-fp32 modules staying float32)."""
    if library is None:
        library, class_name = _origin(module)
    # a library always comes with its class name (``_origin``, the catalog)
    keep = keep_in_fp32(library, cast(str, class_name), dtype) if library else ()
    sizes = tensor_sizes(module, dtype, keep)
    tree = block_tree(sizes, (n for n, m in module.named_modules() if isinstance(m, _LISTS)))
    itemsize = dtype.itemsize if dtype is not None else next((p.element_size() for p in module.parameters()), 4)
    return Component(name, library, class_name, sum(sizes.values()), True, in_flight=finest_in_flight(tree),
                     blocks=split_blocks(sizes), tree=tree, attention_width=attention_width(sizes, itemsize),
                     files=mapped_files(module, dtype), heads=heads_of(getattr(module, "config", None)))


def mapped_files(module: torch.nn.Module, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The safetensors files whose memory maps hold the weights of ``module`` (as diffusers and transformers load
    weights stored at the dtype asked for), or ``()`` when a weight is on a GPU or would be converted, or more than
    ``UNMAPPED_SHARE`` of its bytes are not mapped (buffers built in ``__init__`` never are)."""
    maps, files, unmapped, total = file_maps(), set(), 0, 0
    for tensor in {id(t): t for t in module.state_dict(keep_vars=True).values() if t is not None}.values():
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or (dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype):
            return ()
        found = maps.file_of(address(tensor), nbytes) if nbytes and maps.starts else None
        total += nbytes
        if found is None:
            unmapped += nbytes
        else:
            files.add(found)
    return tuple(sorted(files)) if files and unmapped <= UNMAPPED_SHARE * total else ()


UNMAPPED_SHARE = 0.01


def module_bytes(module: torch.nn.Module, dtype: torch.dtype | None = None, keep_fp32: Iterable[str] = ()) -> int:
    """Bytes of a module's parameters and persistent buffers (shared tensors once), at ``dtype`` if given."""
    return sum(tensor_sizes(module, dtype, keep_fp32).values())


def _origin(value: object) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    return type(value).__module__.split(".")[0], type(value).__name__


def tensor_sizes(module: torch.nn.Module, dtype: torch.dtype | None = None,
                 keep_fp32: Iterable[str] = ()) -> dict[str, int]:
    """``{state_dict key: bytes}`` of a module, each shared tensor under its first key only, at ``dtype`` if given
    (floating tensors only, and those the model class keeps in float32 stay there); a quantized weight (a tensor
    subclass of torchao or quanto) at the bytes it stores, whatever ``dtype``."""
    keep, seen, sizes = tuple(keep_fp32), set(), {}
    for key, tensor in _saved_tensors(module):
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if is_packed(tensor):
            sizes[key] = stored_bytes(tensor)
            continue
        element = tensor.element_size()
        if dtype is not None and tensor.is_floating_point():
            element = 4 if kept_fp32(key, keep) else dtype.itemsize
        sizes[key] = tensor.numel() * element
    return sizes


def live_blocks(module: torch.nn.Module, dtype: torch.dtype | None = None,
                keep_fp32: Iterable[str] = ()) -> tuple[tuple[str, int], ...]:
    """``split_blocks`` of a live module (or one built on the meta device), at ``dtype`` if given."""
    return split_blocks(tensor_sizes(module, dtype, keep_fp32))


def _saved_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor | None]]:
    """What ``state_dict(keep_vars=True)`` holds, by module path, without calling it: a quantized module's own
    ``_save_to_state_dict`` (quanto's) splits a weight into its inner tensors, and fails on a dry run's fakes."""
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        yield from ((prefix + k, t) for k, t in sub._parameters.items())
        yield from ((prefix + k, t) for k, t in sub._buffers.items() if k not in sub._non_persistent_buffers_set)


def submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(module.modules())``: the module and every submodule in the same order, each once, walked with a stack.
    torch's ``modules()`` nests one generator per level, so each module costs a resume per level above it; dispatch
    walks every component three times and each pipeline call once more (``follow``), and those walks were a fifth of
    the time a load added over diffusers' (issue 28)."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        sub = stack.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        found.append(sub)
        if sub._modules:  # a leaf has none: most modules
            stack += [child for child in reversed(sub._modules.values()) if child is not None]
    return found


def near_submodules(module: torch.nn.Module, depth: int) -> list[torch.nn.Module]:
    """The submodules at most ``depth`` levels below ``module`` (not itself), each once, level by level: without
    walking the levels below them, as ``named_modules()`` would."""
    found: list[torch.nn.Module] = []
    seen, level = {id(module)}, [module]
    for _ in range(depth):
        below = []
        for sub in level:
            for child in sub._modules.values():
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    below.append(child)
        found += below
        level = below
    return found


def stream_blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks a streamed component is moved by, in registration order, each module once.

    The elements of the first ModuleList, ModuleDict or Sequential on each path from the root are blocks (a list is
    never one: its own forward never runs); a child holding no such list is one block whole; a child holding one is
    descended into. Tensors outside every block (the root's own, a descended module's own) travel with the root.
    """
    blocks: dict[int, tuple[str, torch.nn.Module]] = {}
    _collect_blocks(module, "", blocks)
    return list(blocks.values())


def _collect_blocks(module: torch.nn.Module, prefix: str, blocks: dict[int, tuple[str, torch.nn.Module]]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, _LISTS):
            for key, element in child.named_children():
                blocks.setdefault(id(element), (f"{path}.{key}", element))
        elif any(isinstance(m, _LISTS) for m in child.modules()):
            _collect_blocks(child, f"{path}.", blocks)
        else:
            blocks.setdefault(id(child), (path, child))
