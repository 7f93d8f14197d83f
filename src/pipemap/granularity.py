"""How a streamed component is cut into pieces, which of them stay on the GPU and how far ahead the next are fetched,
all from the room it has there. Pure: a ``Block`` tree (``inventory.block_tree``) and bytes in, a ``Pieces`` out.

Coarse pieces first (the component's own top-level modules, lists opened), since fewer and larger copies run
faster; a piece larger than its share of the room is streamed as its children, recursively, down to leaf modules (a
tensor is never cut). The tensors of a module streamed as its children, and the root's own, are the *loose* tensors:
they go to the GPU with the call and stay for all of it. What the room holds beyond the pieces in flight keeps pieces
resident, largest first (partial residency): only the rest crosses the host link at each call.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MAX_PREFETCH = 3  # pieces fetched ahead at most: beyond that the copies queue behind each other anyway
PREFETCH_SHARE = 4  # a prefetch deeper than one piece is taken when all the buffers fill at most 1/4 of the room
LOOSE = ""  # the name of the loose tensors among the resident pieces


def stream_charge(root: int, blocks: Iterable[int], depth: int = 1) -> int:
    """GPU bytes a streamed component holds while it runs: its loose tensors, and ``depth + 1`` buffers each the size
    of its largest block (the block running and ``depth`` prefetched), or every block once if that is less.

    >>> stream_charge(10, [30, 20, 50, 40])      # 10 + 2 x 50
    110
    """
    sizes = list(blocks)
    if not sizes:
        return root
    return root + min((depth + 1) * max(sizes), sum(sizes))


@dataclass(frozen=True, slots=True)  # a component has one per module, kept with its inventory (issue 28: memory)
class Block:
    """A module of a component as streaming sees it: its path, the bytes of its subtree, the bytes of its own
    tensors (not in a child) and its children in natural order. ``container``: a ModuleList or ModuleDict (from
    names: all children numbered), whose own forward never runs, so it is never moved as one piece.
    ``inventory.block_tree`` makes them from tensor names."""

    path: str
    bytes: int
    own: int = 0
    children: tuple[Block, ...] = ()
    container: bool = False


@dataclass(frozen=True)
class Pieces:
    """A streamed component's pieces: ``blocks`` ((module path, bytes), ...) in module order, the ``loose`` bytes
    outside them, the ``resident`` pieces (paths; ``""``: the loose tensors) that stay on the GPU, ``prefetch`` pieces
    fetched ahead of the running one, and ``level``: how many times the deepest piece was cut below the component's
    top-level modules (0: none)."""

    blocks: tuple[tuple[str, int], ...]
    loose: int
    resident: tuple[str, ...] = ()
    prefetch: int = 1
    level: int = 0

    @property
    def streamed(self) -> tuple[tuple[str, int], ...]:
        """The pieces that cross the host link at every call."""
        keep = set(self.resident)
        return tuple(b for b in self.blocks if b[0] not in keep)

    @property
    def resident_bytes(self) -> int:
        keep = set(self.resident)
        return sum(size for path, size in self.blocks if path in keep) + (self.loose if LOOSE in keep else 0)

    @property
    def in_flight(self) -> int:
        """Bytes on the GPU for the call beyond the resident ones: the loose tensors (unless resident) and the
        buffers the streamed pieces cycle through (``stream_charge``: the running one and those fetched
        ahead, each the size of the largest)."""
        return stream_charge(0 if LOOSE in self.resident else self.loose, [s for _, s in self.streamed],
                             self.prefetch)

    @property
    def moved_per_call(self) -> int:
        """Bytes copied to the GPU at each call: every streamed piece once, and the loose tensors unless resident."""
        return sum(size for _, size in self.streamed) + (0 if LOOSE in self.resident else self.loose)

    @property
    def copies_per_call(self) -> int:
        return len(self.streamed) + (0 if LOOSE in self.resident or not self.loose else 1)


def top_pieces(tree: Block) -> Iterator[Block]:
    """The component's top-level modules, a list's elements in place of the list."""
    for child in tree.children:
        yield from _opened(child)


def _opened(block: Block) -> Iterator[Block]:
    if block.container:
        for child in block.children:
            yield from _opened(child)
    else:
        yield block


def _loose_of(block: Block) -> int:
    """A block's own bytes and those of the lists opened in its place."""
    return block.own + sum(_loose_of(c) for c in block.children if c.container)


def finest_in_flight(tree: Block) -> int:
    """The fewest bytes a streamed component needs on its GPU: every module cut to its leaves, two buffers the size
    of the largest leaf beside the tensors outside every leaf."""
    if not tree.children:
        return tree.bytes
    leaves, loose = [], 0
    stack = [tree]
    while stack:
        block = stack.pop()
        if block.children:
            loose += block.own
            stack.extend(block.children)
        else:
            leaves.append(block.bytes)
    return stream_charge(loose, leaves)


def cut(tree: Block, room: int, resident_room: int | None = None) -> Pieces | None:
    """The pieces, prefetch depth and resident pieces that move the fewest bytes per call within ``room`` (at most
    ``resident_room`` bytes of them resident: what may stay while other components run); None when even leaf
    modules do not fit.

    The coarsest cut whose two buffers (each the size of its largest piece) fit comes first; finer cuts (largest
    piece halved each time) are weighed too, since smaller buffers leave more room to keep pieces resident. Each
    copy counts as ``COPY_BYTES`` more, so of two cuts that move about the same, the coarser one wins.

    >>> cut(pipemap.inspect("path/to/sdxl")["unet"].tree, 2 * 2**30)        # doctest: +SKIP
    """
    cap = room if resident_room is None else min(room, resident_room)
    key = (id(tree), room, cap)
    if key not in _CUTS or _CUTS[key][0] is not tree:
        if len(_CUTS) > 4096:
            _CUTS.clear()
        _CUTS[key] = (tree, _best_cut(tree, room, cap))
    return _CUTS[key][1]


# plans weigh the same component at the same rooms many times ("auto" tries every strategy); keyed by identity, since
# hashing a tree of a thousand modules costs more than laying it out (the tree is kept in the value, so the id holds)
_CUTS: dict[tuple[int, int, int], tuple[Block, Pieces | None]] = {}


def _best_cut(tree: Block, room: int, cap: int) -> Pieces | None:
    best, limit, previous = None, room, None
    while True:
        cut = _cut(tree, room, limit)
        if cut is None:
            return best
        candidate = _arrange(*cut, room, cap)
        if best is None or _score(candidate) < _score(best):
            best = candidate
        largest = max((size for _, size in cut[0]), default=0)
        if not cap or largest == previous or cut[2] >= MAX_LEVEL:
            return best  # no room to keep pieces, or the largest piece is a leaf: finer cuts gain nothing
        limit, previous = largest // 2, largest


MAX_LEVEL = 12  # cuts below the top-level modules weighed at most; leaf modules lie far shallower in practice
COPY_BYTES = 256 * 1024  # what one more copy costs, in bytes: ~10 us of launch and event at ~25 GB/s


def _score(candidate: Pieces) -> int:
    return candidate.moved_per_call + COPY_BYTES * candidate.copies_per_call


def _arrange(pieces: list[tuple[str, int]], loose: int, level: int, room: int, cap: int) -> Pieces:
    sizes = [size for _, size in pieces]
    prefetch = 1
    for depth in range(MAX_PREFETCH, 1, -1):
        if len(sizes) > depth and stream_charge(loose, sizes, depth) <= room // PREFETCH_SHARE:
            prefetch = depth
            break
    return Pieces(tuple(pieces), loose, _resident(pieces, loose, prefetch, room, cap), prefetch, level)


def _cut(tree: Block, room: int, limit: int) -> tuple[list[tuple[str, int]], int, int] | None:
    """Cut the largest piece into its children until two buffers of its size fit the room beside the loose tensors
    (or every piece once, if less) and none is larger than ``limit``; None when a leaf is too large. Returns
    (pieces, loose bytes, level)."""
    loose = _loose_of(tree)
    heap = [(-b.bytes, i, b, 0) for i, b in enumerate(top_pieces(tree))]
    heapq.heapify(heap)
    order = len(heap)
    while heap:
        largest = -heap[0][0]
        fits = loose + min(2 * largest, tree.bytes - loose) <= room  # the pieces hold all that is not loose
        if fits and largest <= limit:
            break
        if not heap[0][2].children:
            if fits:
                break  # the largest is a leaf: finer cuts cannot lower it
            splittable = [entry for entry in heap if entry[2].children]
            if not splittable:
                return None
            entry = min(splittable)  # the largest piece that can still be cut: the leaf's neighbour in flight
            heap.remove(entry)
            heapq.heapify(heap)
        else:
            entry = heapq.heappop(heap)
        _, _, block, depth = entry
        loose += _loose_of(block)
        for child in _opened_children(block):
            heapq.heappush(heap, (-child.bytes, order, child, depth + 1))
            order += 1
    if not heap and loose > room:
        return None
    pieces = sorted(((b.path, b.bytes, d) for _, _, b, d in heap), key=lambda p: _natural(p[0]))
    return [(p, s) for p, s, _ in pieces], loose, max((d for *_, d in pieces), default=0)


def _opened_children(block: Block) -> Iterator[Block]:
    for child in block.children:
        yield from _opened(child)


def _resident(pieces: list[tuple[str, int]], loose: int, prefetch: int, room: int, cap: int) -> tuple[str, ...]:
    """Largest first, each piece that fits beside the buffers the pieces still streamed need (``prefetch`` + 1 the
    size of the largest of them, or each once if less): keeping a large piece also shrinks the buffers."""
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][1], i))
    keep_loose = 0 < loose <= cap  # the loose tensors run at every call: the cheapest bytes to keep
    held = loose if keep_loose else 0
    kept: list[int] = []
    streamed: list[int] = []  # the pieces passed over, largest first
    rest = sum(size for _, size in pieces)  # bytes of the pieces not yet decided, and those passed over
    for at, i in enumerate(order):
        size = pieces[i][1]
        rest -= size
        after = pieces[order[at + 1]][1] if at + 1 < len(order) else 0
        largest = max(streamed[0] if streamed else 0, after)
        buffers = min((prefetch + 1) * largest, rest)
        if held + size <= cap and held + size + buffers + (0 if keep_loose else loose) <= room:
            kept.append(i)
            held += size
        else:
            streamed.append(size)
            rest += size
    names = tuple(pieces[i][0] for i in sorted(kept))
    return ((LOOSE,) if keep_loose else ()) + names


def _natural(path: str) -> tuple[tuple[int, int, str], ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))
