"""The host tiers: which host copies live in CPU RAM and which stay in their safetensors files, memory-mapped (the
disk tier), within the CPU's budget. Pure: placements and components in, placements with their tiers out.

What the CPU holds for each placement: a component computed on the CPU, whole; an offloaded one, whole; a streamed
one, the pieces that cross the host link at its calls (the pieces kept resident on its GPU need no host copy when
its files are mapped: a reset reads them back from the files); a component on GPUs, nothing.

Host copies whose weights cannot stay in their files (stored at another dtype than the one asked for, or built in
memory: ``Component.files`` is empty) must be in RAM. Of the rest, what is read at every step (a denoiser's pieces)
goes to RAM, the most called and the largest first, while the budget lasts, and the remainder is read from the
files; what runs once a prompt (text encoders, a VAE) is read straight from the map, never pinned: RAM held for one
read per image is RAM a denoiser's pieces could use at every step. Pieces read from the files on their way to a GPU
pass through ``STAGING_SLOTS`` pinned buffers of up to ``STAGING_CHUNK`` bytes per GPU (``hooks.mapped.Staging``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .devices import is_accelerator
from .errors import HostMemoryError
from .granularity import LOOSE
from .inventory.values import Component
from .modes import Peak, facts
from .plan import Placement

STAGING_CHUNK = 64 * 2**20  # bytes a staging buffer holds: large copies run at the link's speed from 8 MiB or so
STAGING_SLOTS = 2  # one filled by the host while the GPU copies from the other


def staging_bytes(largest: int) -> int:
    """Pinned bytes a GPU's staging buffers take when the largest piece it reads from the files has ``largest``.

    >>> staging_bytes(10 * 2**20) == 2 * 10 * 2**20 and staging_bytes(2**30) == 2 * STAGING_CHUNK
    True
    """
    return STAGING_SLOTS * min(STAGING_CHUNK, largest)


@dataclass(frozen=True)
class HostCopy:
    """One host copy that lives in RAM or on the disk: a component's (``piece`` None) or a streamed piece's (``""``:
    its loose tensors), with the calls per image that read it and the device that reads it."""

    component: str
    piece: str | None
    bytes: int
    calls: int
    reader: str
    mappable: bool

    @property
    def by_map(self) -> bool:
        """Read straight from the map: run once a prompt and copied to a GPU, so never worth pinned RAM."""
        return self.mappable and self.calls <= 1 and is_accelerator(self.reader)


def host_copies(p: Placement, c: Component) -> list[HostCopy]:
    """The host copies a placement needs (those resident pieces of a streamed component that must stay in RAM, as
    one copy)."""
    if p.device != "cpu":
        return []
    mappable, reader = bool(c.files), p.execution_device
    if facts(p.mode).peak is not Peak.STREAMED or not p.blocks:
        return [HostCopy(p.component, None, p.bytes, c.calls_per_image, reader, mappable)]
    kept = set(p.resident_blocks)
    copies = [HostCopy(p.component, path, size, c.calls_per_image, reader, mappable)
              for path, size in p.blocks if path not in kept]
    loose = p.bytes - sum(size for _, size in p.blocks)
    if loose > 0 and LOOSE not in kept:
        copies.append(HostCopy(p.component, LOOSE, loose, c.calls_per_image, reader, mappable))
    if p.resident_bytes and not mappable:  # nothing to read them back from at a reset
        copies.append(HostCopy(p.component, None, p.resident_bytes, c.calls_per_image, "cpu", False))
    return copies


def place_tiers(placements: tuple[Placement, ...], components: Mapping[str, Component], budget: int,
                strategy: str) -> tuple[tuple[Placement, ...], int]:
    """Each placement with its disk tier (``disk_blocks``, ``disk_bytes``) and ``files``, and the staging bytes;
    ``HostMemoryError`` when what must be in RAM does not fit ``budget``."""
    copies = [copy for p in placements for copy in host_copies(p, components[p.component])]
    must = [c for c in copies if not c.mappable]
    spilled = [c for c in copies if c.by_map]
    for _ in range(MAX_ROUNDS):  # what spills needs staging, which leaves RAM less room: until that settles
        staging = _staging(spilled)
        room = budget - sum(c.bytes for c in must) - staging
        if room < 0:
            held: dict[str, int] = {}
            for c in must:
                held[c.component] = held.get(c.component, 0) + c.bytes
            largest = max(held, key=lambda name: (held[name], name), default="staging")
            raise HostMemoryError(largest, budget - room, budget, strategy)
        spilled = [*(c for c in copies if c.by_map), *_spilled(copies, room)]
        if _staging(spilled) <= staging:
            break
    on_disk: dict[str, list[HostCopy]] = {}
    for c in spilled:
        on_disk.setdefault(c.component, []).append(c)
    return tuple(_tiered(p, components[p.component], on_disk.get(p.component, [])) for p in placements), staging


MAX_ROUNDS = 8


def _spilled(copies: list[HostCopy], room: int) -> list[HostCopy]:
    """The mappable copies RAM does not take: the most called and largest first fill ``room``."""
    spilled = []
    for c in sorted((c for c in copies if c.mappable and not c.by_map), key=lambda c: (-c.calls, -c.bytes)):
        if c.bytes <= room:
            room -= c.bytes
        else:
            spilled.append(c)
    return spilled


def _staging(disk: list[HostCopy]) -> int:
    largest: dict[str, int] = {}
    for c in disk:
        if is_accelerator(c.reader):
            largest[c.reader] = max(largest.get(c.reader, 0), c.bytes)
    return sum(staging_bytes(size) for size in largest.values())


def _tiered(p: Placement, c: Component, disk: list[HostCopy]) -> Placement:
    if p.device != "cpu" or not c.files:
        return p
    order = {path: i for i, (path, _) in enumerate(p.blocks)}
    pieces = tuple(sorted((copy.piece for copy in disk if copy.piece is not None), key=lambda x: order.get(x, -1)))
    kept = p.resident_bytes if facts(p.mode).peak is Peak.STREAMED else 0
    # pieces are counted as they sit in a packed buffer (each tensor aligned): a little above the component's bytes
    return replace(p, disk_blocks=pieces, disk_bytes=min(sum(copy.bytes for copy in disk), p.bytes - kept),
                   files=c.files)
