"""A component's module tree from its tensor names and bytes: the blocks a split may cut between, the pieces
streaming moves, the width of its attention. Plain arithmetic on ``{tensor name: bytes}``; the names come from a
folder's headers (``folder``) or a live module (``live``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from ..granularity import Block, finest_in_flight
from ..units import aligned


def streamed_bytes(sizes: Mapping[str, int]) -> int:
    """The fewest bytes in flight when a component is streamed, from its tensor names: its blocks as fine as they
    go (leaf modules), the two largest of them plus every tensor outside them (``granularity.finest_in_flight``).

    Buffers that are not saved (``position_ids``) are not counted.
    """
    return finest_in_flight(block_tree(sizes))


# the query projection of a self-attention layer: diffusers' ``attn``/``attn1`` (``attn2`` is cross-attention),
# transformers' CLIP ``self_attn``, T5 ``SelfAttention``
_SELF_QUERY = re.compile(r"(?:^|\.)(?:attn1?|self_attn|SelfAttention)\.(?:to_q|q_proj|q)\.weight$")


def attention_width(sizes: Mapping[str, int], itemsize: int) -> int:
    """The widths of a component's self-attention layers, summed (a square query projection of ``w`` x ``w``)."""
    return sum(math.isqrt(size // itemsize) for key, size in sizes.items() if _SELF_QUERY.search(key))


def block_tree(sizes: Mapping[str, int], containers: Iterable[str] | None = None) -> Block:
    """The module tree of a component from its tensor names and bytes (each aligned as in a streaming buffer): a
    tensor belongs to the module its name names without the last part. ``containers`` names the ModuleLists and
    ModuleDicts (from a live module); without it, a module whose children are all numbered is taken for one."""
    own: dict[str, int] = {}
    kids: dict[str, list[str]] = {"": []}
    for key, size in sizes.items():
        module = key.rpartition(".")[0]
        own[module] = own.get(module, 0) + aligned(size)  # as the tensor sits in a streaming buffer
        path, child = module, None
        while path not in kids:  # a module met before has its parents already ("" is the root's)
            kids[path] = [] if child is None else [child]
            path, child = path.rpartition(".")[0], path
        if child is not None:
            kids[path].append(child)
    return _node("", own, kids, None if containers is None else frozenset(containers))


def _node(path: str, own: Mapping[str, int], kids: Mapping[str, list[str]], containers: frozenset[str] | None
          ) -> Block:
    children = tuple(_node(k, own, kids, containers) for k in sorted(kids[path], key=_last_natural))
    if containers is not None:
        container = path in containers
    else:
        container = bool(children) and all(c.path.rpartition(".")[2].isdigit() for c in children)
    mine = own.get(path, 0)
    return Block(path, mine + sum(c.bytes for c in children), mine, children, container and bool(path))


def split_blocks(sizes: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The elements of a component's module lists (``transformer_blocks.7``, ``down_blocks.1``) with their bytes, in
    list order: where a split may cut. Tensors outside every list stay with the component's first GPU."""
    groups: dict[str, int] = {}
    for name, size in sizes.items():
        key = block_key(name)
        if key.rpartition(".")[2].isdigit():
            groups[key] = groups.get(key, 0) + size
    return tuple(sorted(groups.items(), key=lambda item: _natural(item[0])))


def _natural(path: str) -> tuple[tuple[int, int, str], ...]:
    return tuple(map(_natural_part, path.split(".")))


def _last_natural(path: str) -> tuple[int, int, str]:
    """``_natural`` of the last part only: what orders siblings (issue 28: the whole path's was most of a tree's
    time)."""
    return _natural_part(path.rpartition(".")[2])


def _natural_part(part: str) -> tuple[int, int, str]:
    return (0, int(part), "") if part.isdigit() else (1, 0, part)


def block_key(name: str) -> str:
    """The block a tensor name belongs to (see ``streamed_bytes``); ``""`` for the root module's own tensors."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return parts[0] if len(parts) > 1 else ""
