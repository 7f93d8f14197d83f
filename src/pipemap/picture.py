"""Pictures of a plan and of a dry run: each device's memory as a bar, and memory over a call as a timeline.

One drawing, three outputs: an SVG string (files, notebooks, the server's home page), a rich renderable for the
terminal (80 columns), and the HTML a notebook shows. The SVG is written by hand, not by a plotting library: it is a
few rectangles and labels, a plotting extra (matplotlib, ~40 MB) would buy nothing we draw, and a hand-written file
keeps its numbers as plain attributes a test can parse back (``data-bytes``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING, Any, Protocol

from .modes import TABLE, Peak, at_home, facts
from .modes import Placed as _Placement
from .units import format_bytes

if TYPE_CHECKING:
    from rich.console import Group
    from rich.text import Text

# A ``plan.Plan`` and its placements are read by their fields (the protocols below, and ``modes.Placed``): plan.py
# imports this module (``Plan.picture``), so this one does not import plan.py, not even for the type checker.


class _DeviceUse(Protocol):
    @property
    def device(self) -> str: ...

    @property
    def memory(self) -> int: ...

    @property
    def budget(self) -> int: ...

    @property
    def used(self) -> int: ...


class _Plan(Protocol):
    """What the picture reads of a ``plan.Plan``."""

    @property
    def strategy(self) -> str: ...

    @property
    def dtype(self) -> str | None: ...

    @property
    def components(self) -> tuple[_Placement, ...]: ...

    @property
    def devices(self) -> tuple[_DeviceUse, ...]: ...


# fills chosen to differ in lightness as well as hue, so neighbours stay apart in greyscale
PALETTE = ("#1b4f72", "#f5b041", "#7d3c98", "#a9dfbf", "#922b21", "#85c1e9", "#145a32", "#f9e79f", "#4d5656",
           "#f1948a")
HEADROOM_FILL = "#e5e7e9"
OTHER_PATTERNS = {"disk": "dots"}  # the kinds of segment that are no mode (a mode's pattern is in its row)
GIB = 1 << 30


@dataclass(frozen=True)
class Segment:
    """Part of a device's bar: ``label`` holds ``bytes`` there; ``kind`` is the placement mode, or ``"headroom"``."""

    label: str
    bytes: int
    kind: str


@dataclass(frozen=True)
class Bar:
    """One device: its memory, the plan's budget line, and what the plan puts there (``segments`` add up to
    ``used``), then the headroom the budget keeps back for activations."""

    device: str
    memory: int
    budget: int
    used: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Link:
    """Bytes one image moves from ``source`` to ``target`` (host to GPU for offload and streaming, GPU to GPU for
    a split component's activations, a copy's inputs and outputs, a sequence split's exchanges)."""

    source: str
    target: str
    bytes_per_image: int


@dataclass(frozen=True)
class Picture:
    """A plan drawn: a title, one bar per device, and the links that carry bytes per image."""

    title: str
    bars: tuple[Bar, ...]
    links: tuple[Link, ...] = ()

    def svg(self) -> str:
        return _plan_svg(self)

    def __rich__(self) -> Group:
        return _plan_rich(self)

    def text(self, width: int = 80) -> str:
        """The terminal drawing as plain text (no colour)."""
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=width, color_system=None, force_terminal=False).print(self)
        return buffer.getvalue().rstrip()


def plan_picture(plan: _Plan, moved: Mapping[str, int] | None = None) -> Picture:
    """The picture of ``plan``: per device, each component it holds (offloaded and streamed components as the most
    they hold there at once), the headroom and the budget line.

    ``moved`` maps components to the bytes one image moves for them (``pipemap.cost.bytes_moved``); without it
    the links are left out.

    >>> plan = pipemap.plan("path/to/sdxl", hardware="2x8GiB", strategy="balanced_low_memory")  # doctest: +SKIP
    >>> print(plan_picture(plan).text())                                                        # doctest: +SKIP
    """
    bars = tuple(_bar(plan, d.device, d.memory, d.budget, d.used) for d in plan.devices)
    title = f"pipemap plan: {plan.strategy}" + (f", {plan.dtype}" if plan.dtype else "")
    return Picture(title, bars + _disk_bar(plan), _links(plan, moved or {}))


def _bar(plan: _Plan, device: str, memory: int, budget: int, used: int) -> Bar:
    segments = [Segment(p.component, at_home(p, device), p.mode) for p in plan.components if at_home(p, device)]
    staging = int(getattr(plan, "staging", 0))
    if device == "cpu" and staging:
        segments.append(Segment("staging (pinned, for reads from the disk)", staging, "stream"))
    segments += [Segment(f"{p.component} ({facts(p.mode).label})", sum(s for _, d, s in p.shards if d == device),
                         p.mode) for p in plan.components if any(d == device for _, d, _s in p.shards)]
    moved = [p for p in plan.components if facts(p.mode).moves_weights and p.execution_device == device
             and p.device != device]
    streamed = [p for p in moved if facts(p.mode).peak is Peak.STREAMED]
    segments += [Segment(f"{p.component} (resident pieces)", p.resident_bytes, p.mode)
                 for p in streamed if p.resident_bytes]
    segments += [Segment(f"{p.component} ({facts(p.mode).label})", p.room, p.mode) for p in streamed]
    segments += [Segment(f"{p.component} ({facts(p.mode).label})", p.bytes, p.mode)
                 for p in plan.components if device in p.replicas]
    # the planner charges an execution GPU its largest offloaded component (the LRU keeps what fits): whatever of
    # ``used`` the segments above leave is that charge
    rest = used - sum(s.bytes for s in segments)
    offloaded = [p.component for p in moved if facts(p.mode).peak is Peak.ONLOADED]
    if rest > 0:
        segments.append(Segment("onloaded: " + " | ".join(offloaded) if offloaded else "other", rest, "offload"))
    return Bar(device, memory, budget, used, tuple(segments))


def _disk_bar(plan: Any) -> tuple[Bar, ...]:
    """The disk tier as a bar: each component's bytes read from its files at each call. Pieces a streamed component
    keeps resident on its GPU have their files as their only host copy too, but are drawn once, on that GPU."""
    segments = tuple(Segment(p.component, p.disk_bytes, "disk") for p in plan.components
                     if getattr(p, "disk_bytes", 0))
    total = sum(s.bytes for s in segments)
    return (Bar("disk", total, total, total, segments),) if total else ()


def _links(plan: _Plan, moved: Mapping[str, int]) -> tuple[Link, ...]:
    totals: dict[tuple[str, str], int] = {}
    for p in plan.components:
        amount = moved.get(p.component, 0)
        if not amount:
            continue
        key = (p.device, _shard_device(p)) if p.shards else (p.device, p.replicas[0]) if p.replicas else (
            p.device, p.execution_device)
        totals[key] = totals.get(key, 0) + amount
    return tuple(Link(s, t, b) for (s, t), b in totals.items())


def _pattern(kind: str) -> str | None:
    """A segment's fill pattern: its mode's (the mode table's row), or that of a kind that is no mode."""
    row = TABLE.get(kind)
    return (row.pattern or None) if row is not None else OTHER_PATTERNS.get(kind)


def _shard_device(p: _Placement) -> str:
    return p.shards[0][1] if p.shards else p.device


# ---- SVG ------------------------------------------------------------------------------------------------------

ROW, LABEL_W, BAR_W, PAD = 46, 150, 520, 12


def _plan_svg(picture: Picture) -> str:
    colours = _colours(picture)
    cut: list[str] = []  # segment labels too long for their segment: keyed [1], [2]... and written out below
    bars = [_svg_bar(bar, PAD * 2 + 24 + row * ROW, colours, cut) for row, bar in enumerate(picture.bars)]
    lines = len(picture.links) + len(colours) + 2 + (len(cut) + 1 if cut else 0)
    height = PAD * 3 + 24 + ROW * len(picture.bars) + 18 * lines
    width = LABEL_W + BAR_W + 110
    parts = [_svg_open(width, height, picture.title), _patterns(),
             f'<text x="{PAD}" y="{PAD + 14}" font-size="15" font-weight="bold">{escape(picture.title)}</text>', *bars]
    y = PAD * 2 + 24 + ROW * len(picture.bars) + 4
    for name, colour in colours.items():
        y += 18
        parts.append(f'<g class="legend"><rect x="{PAD + 10}" y="{y - 11}" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{PAD + 28}" y="{y}" font-size="12">{escape(name)}: {_where(picture, name)}</text></g>')
    for key, text in enumerate(cut, start=1):
        y += 18
        parts.append(f'<g class="cut"><text x="{PAD + 10}" y="{y}" font-size="12">[{key}] {escape(text)}</text></g>')
    y += 24
    if picture.links:
        parts.append(f'<text x="{PAD}" y="{y}" font-size="12" font-weight="bold">bytes moved per image</text>')
    for link in picture.links:
        y += 18
        parts.append(f'<g class="link" data-source="{escape(link.source)}" data-target="{escape(link.target)}" '
                     f'data-bytes="{link.bytes_per_image}"><text x="{PAD + 10}" y="{y}" font-size="12">'
                     f'{escape(link.source)} \u2192 {escape(link.target)}: '
                     f'{format_bytes(link.bytes_per_image)}</text></g>')
    return "\n".join([*parts, "</svg>"])


def _svg_open(width: int, height: int, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" role="img">'
            f'<title>{escape(title)}</title>')


def _patterns() -> str:
    # offloaded and streamed segments are hatched or dotted as well as coloured: the mode reads without colour
    return ('<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#ffffff" stroke-width="2" '
            'stroke-opacity="0.6"/></pattern><pattern id="dots" width="5" height="5" patternUnits="userSpaceOnUse">'
            '<circle cx="2.5" cy="2.5" r="1.1" fill="#ffffff" fill-opacity="0.7"/></pattern></defs>')


def _svg_bar(bar: Bar, y: int, colours: Mapping[str, str], cut: list[str]) -> str:
    scale = BAR_W / max(bar.memory, bar.used, 1)
    x0 = LABEL_W
    kind = "disk" if bar.device == "disk" else "device"  # the disk tier is drawn as a bar, but is no device
    parts = [f'<g class="{kind}" data-device="{escape(bar.device)}" data-memory="{bar.memory}" '
             f'data-budget="{bar.budget}" data-used="{bar.used}">',
             f'<text x="{PAD}" y="{y + 15}" font-size="13" font-weight="bold">{escape(bar.device)}</text>',
             f'<text x="{PAD}" y="{y + 31}" font-size="11">{format_bytes(bar.used)} of '
             f'{format_bytes(bar.budget)}</text>',
             f'<rect x="{x0}" y="{y}" width="{BAR_W}" height="26" fill="none" stroke="#555"/>']
    x = float(x0)
    for seg in bar.segments:
        w = seg.bytes * scale
        parts.append(_svg_segment(seg, x, y, w, colours[seg.label.split(" ")[0]], cut))
        x += w
    headroom = max(0, bar.memory - bar.budget)
    if headroom:
        parts.append(f'<rect class="headroom" x="{x0 + bar.budget * scale:.2f}" y="{y}" width="{headroom * scale:.2f}" '
                     f'height="26" fill="{HEADROOM_FILL}" data-bytes="{headroom}"><title>headroom for activations: '
                     f'{format_bytes(headroom)}</title></rect>')
    bx = x0 + bar.budget * scale
    parts.append(f'<line class="budget" x1="{bx:.2f}" x2="{bx:.2f}" y1="{y - 4}" y2="{y + 30}" stroke="#c0392b" '
                 f'stroke-width="2" data-bytes="{bar.budget}"/>')
    parts.append(f'<text x="{x0 + BAR_W + 8}" y="{y + 17}" font-size="11">{format_bytes(bar.memory)}</text></g>')
    return "\n".join(parts)


def _svg_segment(seg: Segment, x: float, y: int, w: float, colour: str, cut: list[str]) -> str:
    pattern = _pattern(seg.kind)
    overlay = (f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="26" fill="url(#{pattern})"/>' if pattern else "")
    text = f"{seg.label} {format_bytes(seg.bytes)}"
    if len(text) > w // 6 and w > 24:  # no room for it whole: a key here, the label in full under the bars
        cut.append(text)
        text = f"[{len(cut)}]"
    # a halo of the segment's own colour under the letters: readable over the hatch and the dots of its pattern
    label = (f'<text x="{x + 3:.2f}" y="{y + 17}" font-size="10" fill="{_ink(colour)}" stroke="{colour}" '
             f'stroke-width="3" paint-order="stroke">{escape(text)}</text>')
    return (f'<g class="segment" data-label="{escape(seg.label)}" data-kind="{seg.kind}" data-bytes="{seg.bytes}">'
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="26" fill="{colour}" stroke="#fff" stroke-width="0.5">'
            f'<title>{escape(seg.label)} ({seg.kind}): {format_bytes(seg.bytes)}</title></rect>{overlay}'
            f'{label if w > 24 else ""}</g>')


def _where(picture: Picture, name: str) -> str:
    held = {b.device: sum(s.bytes for s in b.segments if s.label.split(" ")[0] == name) for b in picture.bars}
    return ", ".join(f"{format_bytes(v)} on {d}" for d, v in held.items() if v)


def _ink(colour: str) -> str:
    """Black text on light fills, white on dark (relative luminance, sRGB weights)."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 140 else "#fff"


def _colours(picture: Picture) -> dict[str, str]:
    names = []
    for bar in picture.bars:
        names += [s.label.split(" ")[0] for s in bar.segments if s.label.split(" ")[0] not in names]
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


# ---- terminal -------------------------------------------------------------------------------------------------

STYLES = ("blue", "yellow", "magenta", "green", "red", "cyan", "bright_green", "bright_yellow", "white", "bright_red")
CHARS = "\u2588\u2593\u2592"


def _plan_rich(picture: Picture, width: int = 46) -> Group:
    from rich.console import Group
    from rich.text import Text

    colours = {name: STYLES[i % len(STYLES)] for i, name in enumerate(_colours(picture))}
    lines = [Text(picture.title, style="bold")]
    for bar in picture.bars:
        lines.append(_rich_bar(bar, width, colours))
    for name, style in colours.items():
        lines.append(Text.assemble(("\u2588\u2588 ", style), (f"{name}: {_where(picture, name)}", "")))
    lines += [Text(f"{link.source} -> {link.target}: {format_bytes(link.bytes_per_image)} per image")
              for link in picture.links]
    return Group(*lines)


def _rich_bar(bar: Bar, width: int, colours: Mapping[str, str]) -> Text:
    from rich.text import Text

    scale = width / max(bar.memory, bar.used, 1)
    text = Text(f"{bar.device:<8} ")
    cells = 0
    for seg in bar.segments:
        n = max(1, round(seg.bytes * scale)) if seg.bytes else 0
        char = CHARS[0] if seg.kind == "resident" else CHARS[1]
        text.append(char * n, style=colours[seg.label.split(" ")[0]])
        cells += n
    budget_cell = round(bar.budget * scale)
    if cells < budget_cell:
        text.append("\u00b7" * (budget_cell - cells))
        cells = budget_cell
    text.append("|", style="bold red")
    text.append("\u2591" * max(0, width - cells), style="dim")
    text.append(f" {format_bytes(bar.used)}/{format_bytes(bar.budget)}")
    return text


# ---- timeline of a dry run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """A device's bytes in use at one point of the dry run, in which phase (``"denoise step 1"``)."""

    index: int
    device: str
    bytes: int
    phase: str


def timeline_svg(samples: Sequence[Sample], budgets: Mapping[str, int], title: str,
                 peak_component: Mapping[str, str] | None = None) -> str:
    """Memory over the call, one panel per device: a step line of bytes in use, the budget line, the peak marked
    and labelled with its phase. Each panel carries ``data-peak`` (bytes) for tests and scripts."""
    seen = set(s.device for s in samples)
    devices = [d for d in budgets if d in seen] + [d for d in dict.fromkeys(s.device for s in samples)
                                                   if d not in budgets]
    panel, width = 120, LABEL_W + BAR_W + 110
    parts = [_svg_open(width, PAD * 2 + 24 + panel * len(devices), title),
             f'<text x="{PAD}" y="{PAD + 14}" font-size="15" font-weight="bold">{escape(title)}</text>']
    for row, device in enumerate(devices):
        mine = [s for s in samples if s.device == device]
        parts.append(_timeline_panel(device, mine, budgets.get(device, 0), PAD * 2 + 24 + row * panel, panel - 30,
                                     (peak_component or {}).get(device, "")))
    return "\n".join([*parts, "</svg>"])


def _timeline_panel(device: str, samples: Sequence[Sample], budget: int, y: int, h: int, who: str = "") -> str:
    top = max([s.bytes for s in samples] + [budget, 1])
    last = max(s.index for s in samples) or 1
    peak = max(samples, key=lambda s: s.bytes)

    def px(s: Sample) -> tuple[float, float]:
        return LABEL_W + BAR_W * s.index / last, y + h - h * s.bytes / top

    points = " ".join(f"{x:.1f},{yy:.1f}" for x, yy in map(px, samples))
    phases, last_label = [], -1e9
    for before, s in zip([None, *samples], samples):
        if before is None or before.phase != s.phase:
            x = px(s)[0]
            label = x - last_label > 70
            last_label = x if label else last_label
            phases.append(f'<line class="phase" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + h}" stroke="#ccc" '
                          f'data-phase="{escape(s.phase)}"/>' + (f'<text x="{x + 2:.1f}" y="{y + h + 11}" '
                                                                 f'font-size="9" fill="#555">{escape(s.phase)}</text>'
                                                                 if label else ""))
    bx, by = px(peak)
    budget_y = y + h - h * budget / top
    return "\n".join([
        f'<g class="timeline" data-device="{escape(device)}" data-peak="{peak.bytes}" data-budget="{budget}" '
        f'data-peak-phase="{escape(peak.phase)}" data-peak-component="{escape(who)}">',
        f'<text x="{PAD}" y="{y + 15}" font-size="13" font-weight="bold">{escape(device)}</text>',
        f'<text x="{PAD}" y="{y + 31}" font-size="11">peak {format_bytes(peak.bytes)}</text>',
        f'<rect x="{LABEL_W}" y="{y}" width="{BAR_W}" height="{h}" fill="none" stroke="#aaa"/>',
        _memory_axis(top, y, h),
        *phases,
        f'<polyline points="{points}" fill="none" stroke="#1b4f72" stroke-width="1.5"/>',
        f'<g class="budget" data-bytes="{budget}"><line x1="{LABEL_W}" x2="{LABEL_W + BAR_W}" y1="{budget_y:.1f}" '
        f'y2="{budget_y:.1f}" stroke="#c0392b" stroke-dasharray="4 3"/><text x="{LABEL_W + BAR_W - 4}" '
        f'y="{budget_y - 3:.1f}" font-size="10" fill="#c0392b" text-anchor="end">budget '
        f'{format_bytes(budget)}</text></g>' if budget else "",
        f'<circle cx="{bx:.1f}" cy="{by:.1f}" r="4" fill="#c0392b"><title>peak {format_bytes(peak.bytes)} in '
        f'{escape(peak.phase)}</title></circle>',
        f'<text x="{min(bx + 6, LABEL_W + BAR_W - 140):.1f}" y="{max(by - 6, y + 10):.1f}" font-size="11">'
        f'peak: {escape(peak.phase)}{" (" + escape(who) + ")" if who else ""}</text></g>'])


def _memory_axis(top: int, y: int, h: int) -> str:
    """The panel's memory axis: its title, and round sizes in the unit ``top`` reads in (KiB, MiB, GiB), each a
    tick, a faint grid line and a label inside the plot."""
    name, unit = _unit(top)
    parts = [f'<g class="axis" data-unit="{name}" data-top="{top}"><text class="axis-title" x="{LABEL_W + 3}" '
             f'y="{y - 3}" font-size="9" fill="#555">memory in use ({name})</text>']
    for size in memory_ticks(top):
        ty = y + h - h * size / top
        parts.append(f'<g class="tick" data-bytes="{size}"><line x1="{LABEL_W - 4}" x2="{LABEL_W + BAR_W}" '
                     f'y1="{ty:.1f}" y2="{ty:.1f}" stroke="#eee"/><text x="{LABEL_W + 3}" y="{ty - 2:.1f}" '
                     f'font-size="9" fill="#777">{size / unit:g} {name}</text></g>')
    return "\n".join([*parts, "</g>"])


def _unit(size: int) -> tuple[str, int]:
    """The unit ``format_bytes`` writes ``size`` in, and its bytes."""
    return next(((name, unit) for name, unit in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
                 if size >= unit), ("B", 1))


def memory_ticks(top: int, most: int = 5) -> list[int]:
    """Round sizes from 0 up to ``top`` for an axis: steps of 1, 2, 2.5 or 5 times a power of ten of the unit
    ``top`` reads in, at most ``most`` of them."""
    unit = _unit(top)[1]
    raw = max(top / unit / (most - 1), 1e-9)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw) * unit
    return [round(i * step) for i in range(int(top // step) + 1)]


@dataclass(frozen=True)
class Timeline:
    """A dry run's memory over the call, per device (``SimulationReport.picture()``)."""

    title: str
    samples: tuple[Sample, ...]
    budgets: Mapping[str, int]
    peak_component: Mapping[str, str]

    def svg(self) -> str:
        return timeline_svg(self.samples, self.budgets, self.title, self.peak_component)

    def _repr_html_(self) -> str:
        return self.svg()
