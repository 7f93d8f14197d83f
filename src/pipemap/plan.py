"""The plan: where each component lives and how, as a frozen value you can print, compare and save.

Making a plan moves nothing; ``pipemap.dispatch`` and ``pipemap.load`` apply one.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace

from rich.console import Console
from rich.table import Table

from .hardware import normalize_device
from .units import format_bytes

MODES = ("resident", "offload", "stream", "split")


@dataclass(frozen=True)
class Placement:
    """One component's place: ``device`` holds its weights; it computes on ``execution_device``.

    ``mode`` is ``"resident"`` (lives on its device), ``"offload"`` (lives in CPU RAM, moved whole to its
    execution device for its call and kept there while ``room`` allows) or ``"stream"`` (lives in CPU RAM, moved
    block by block, the next block prefetched). ``room``: for ``"offload"``, the bytes its execution device keeps
    for onloaded components (shared by all offloaded there, least recently used evicted first); for ``"stream"``,
    the bytes of its blocks in flight; 0 when resident. It travels with the placement through ``remap``, so a plan
    remapped onto the CPU keeps each GPU's eviction behaviour. ``"split"``: the component lives on several GPUs;
    ``shards`` lists the blocks (module paths) placed away from ``device`` with their device and bytes, and
    everything else stays on ``device``, where its inputs and outputs live.
    """

    component: str
    device: str
    bytes: int
    mode: str = "resident"
    execution_device: str = ""
    room: int = 0
    shards: tuple[tuple[str, str, int], ...] = ()

    def __post_init__(self):
        if not self.execution_device:
            object.__setattr__(self, "execution_device", self.device)


def _mode_text(p: Placement) -> str:
    if p.mode == "split":
        away: dict[str, int] = {}
        for _, device, size in p.shards:
            away[device] = away.get(device, 0) + size
        return "split: " + ", ".join(f"{format_bytes(b)} on {d}" for d, b in away.items())
    return p.mode if p.mode == "resident" else f"{p.mode} (room {format_bytes(p.room)})"


@dataclass(frozen=True)
class Candidate:
    """One plan ``"auto"`` weighed: its strategy, predicted seconds per image (None: it does not fit, and
    ``reason`` says why) and each device's peak bytes."""

    strategy: str
    seconds: float | None
    peaks: tuple[tuple[str, int], ...]
    reason: str = ""


@dataclass(frozen=True)
class DeviceUse:
    """A device's budget (its memory less the headroom kept for activations) and what the plan puts there."""

    device: str
    memory: int
    budget: int
    used: int


@dataclass(frozen=True)
class Plan:
    """Where every component of a pipeline goes.

    >>> plan = pipemap.plan("path/to/sdxl", hardware="2x16GiB,cpu=64GiB", dtype=torch.float16)  # doctest: +SKIP
    >>> plan.device_map                                                                          # doctest: +SKIP
    {'unet': 'cuda:0', 'text_encoder_2': 'cuda:1', 'vae': 'cuda:1', 'text_encoder': 'cuda:1'}
    """

    strategy: str
    components: tuple[Placement, ...]
    devices: tuple[DeviceUse, ...]
    execution_device: str
    dtype: str | None = None
    variant: str | None = None
    notes: tuple[str, ...] = field(default=())
    candidates: tuple[Candidate, ...] = field(default=())

    @property
    def device_map(self) -> dict[str, str]:
        """``{component: device}`` as diffusers' ``hf_device_map`` has it."""
        return {p.component: p.device for p in self.components}

    def placement(self, component: str) -> Placement:
        for p in self.components:
            if p.component == component:
                return p
        raise KeyError(component)

    def remap(self, mapping: dict[str, str]) -> Plan:
        """The same plan on other devices, every mode kept: ``plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"})``."""
        move = {normalize_device(k): normalize_device(v) for k, v in mapping.items()}

        def dev(name: str) -> str:
            return move.get(name, name)

        components = tuple(replace(p, device=dev(p.device), execution_device=dev(p.execution_device),
                                   shards=tuple((path, dev(d), size) for path, d, size in p.shards))
                           for p in self.components)
        merged: dict[str, DeviceUse] = {}
        for d in self.devices:
            name = dev(d.device)
            old = merged.get(name)
            merged[name] = d if old is None else DeviceUse(name, old.memory + d.memory, old.budget + d.budget,
                                                          old.used + d.used)
            merged[name] = replace(merged[name], device=name)
        return replace(self, components=components, devices=tuple(merged.values()),
                       execution_device=dev(self.execution_device))

    # ---- printing and JSON -------------------------------------------------------------------------------------

    def table(self) -> Table:
        """The plan as a rich table (components, then devices), for printing to a terminal."""
        table = Table(title=f"pipemap plan: strategy {self.strategy!r}, execution device {self.execution_device}"
                      + (f", dtype {self.dtype}" if self.dtype else ""))
        for column in ("component", "device", "mode", "runs on", "bytes"):
            table.add_column(column, justify="right" if column == "bytes" else "left")
        for p in self.components:
            table.add_row(p.component, p.device, _mode_text(p), p.execution_device, format_bytes(p.bytes))
        table.add_section()
        for d in self.devices:
            table.add_row(f"[{d.device}]", d.device, "total", "", f"{format_bytes(d.used)} of {format_bytes(d.budget)}")
        return table

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=100, color_system=None, force_terminal=False).print(self.table())
        return "\n".join([buffer.getvalue().rstrip(), *(f"note: {n}" for n in self.notes)])

    def explain(self) -> str:
        """Why this plan: the candidates ``"auto"`` weighed, their predicted seconds per image and per-device peaks,
        and which won. Plans from a fixed strategy have no candidates and say so."""
        if not self.candidates:
            return f"strategy {self.strategy!r} was asked for; no other plan was weighed"
        ranked = sorted(self.candidates, key=lambda c: (c.seconds is None, c.seconds or 0.0))
        lines = [f"{'strategy':<34}{'s/image':>10}  peaks per device"]
        for c in ranked:
            peaks = ", ".join(f"{d} {format_bytes(b)}" for d, b in c.peaks)
            figure = f"{c.seconds:>10.3g}" if c.seconds is not None else f"{'-':>10}"
            lines.append(f"{c.strategy:<34}{figure}  {peaks or c.reason}")
        return "\n".join(lines + [n for n in self.notes if n.startswith("auto:")])

    def picture(self, moved=None):
        """The plan drawn: each device a bar of its memory (``print(plan.picture())`` in a terminal,
        ``plan.picture().svg()`` for a file); ``moved`` maps components to bytes moved per image, for the links.
        See ``pipemap.picture``."""
        from .picture import plan_picture

        return plan_picture(self, moved)

    def _repr_html_(self) -> str:
        """What a notebook shows: the picture, then the table's notes."""
        from html import escape

        notes = "".join(f"<li>{escape(n)}</li>" for n in self.notes)
        return f"<div class='pipemap-plan'>{self.picture().svg()}" + (f"<ul>{notes}</ul>" if notes else "") + "</div>"

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "execution_device": self.execution_device,
            "dtype": self.dtype,
            "variant": self.variant,
            "devices": {d.device: {"memory": d.memory, "budget": d.budget, "used": d.used} for d in self.devices},
            "components": {p.component: {"device": p.device, "mode": p.mode, "bytes": p.bytes,
                                         "execution_device": p.execution_device, "room": p.room,
                                         **({"shards": {path: {"device": d, "bytes": size} for path, d, size
                                                        in p.shards}} if p.shards else {})}
                           for p in self.components},
            "notes": list(self.notes),
            **({"candidates": [{"strategy": c.strategy, "seconds": c.seconds, "peaks": dict(c.peaks),
                                "reason": c.reason} for c in self.candidates]} if self.candidates else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        devices = tuple(DeviceUse(name, d.get("memory", d["budget"]), d["budget"], d["used"])
                        for name, d in data["devices"].items())
        components = tuple(Placement(name, c["device"], c["bytes"], c.get("mode", "resident"),
                                     c.get("execution_device", ""), c.get("room", 0),
                                     tuple((path, s["device"], s["bytes"]) for path, s in c.get("shards", {}).items()))
                           for name, c in data["components"].items())
        candidates = tuple(Candidate(c["strategy"], c["seconds"], tuple(c["peaks"].items()), c.get("reason", ""))
                           for c in data.get("candidates", ()))
        return cls(data["strategy"], components, devices, data["execution_device"], data.get("dtype"),
                   data.get("variant"), tuple(data.get("notes", ())), candidates)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
