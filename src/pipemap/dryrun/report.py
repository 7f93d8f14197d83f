"""What a dry run reports: whether the plan ran (``ok``), what broke (the operation, component and devices), whether
it fits (``fits``: every device's peak within its memory, else an ``Overrun`` per device with its advice), and each
device's weights, activations and peak with the phase and component that set it, and its memory over the call."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from html import escape

import torch

from ..modes import slack
from ..picture import Sample, Timeline
from ..plan import Plan
from ..units import format_bytes


@dataclass(frozen=True)
class Failure:
    """What went wrong in a dry run: the operation, the component running it (None: pipeline code), the devices."""

    operation: str
    component: str | None
    devices: tuple[str, ...]
    message: str
    where: str = ""

    def __str__(self) -> str:
        who = f"in {self.component!r}" if self.component else "in the pipeline's own code"
        at = f" at {self.where}" if self.where else ""
        return f"{self.operation} {who}{at} on {', '.join(self.devices) or '?'}: {self.message}"


@dataclass(frozen=True)
class Overrun:
    """A device whose peak in a dry run passed its memory: the figures, what set the peak, and what would help."""

    device: str
    peak: int
    memory: int
    phase: str
    component: str
    weights: int
    slack: int = 0  # what CUDA's caching allocator keeps reserved beside the peak (``modes.slack``)

    def advice(self) -> str:
        """What would bring the peak under the memory, from what filled it: the weights, VAE decode, or a call's
        activations."""
        if self.weights > self.memory:
            return (f"its weights alone take {format_bytes(self.weights)}: a GPU with more memory, more GPUs, or "
                    "--strategy balanced_low_memory / balanced_ultra_low_memory (weights kept in CPU RAM, onloaded "
                    "at their call)")
        activations = self.peak - self.weights
        calls = "a smaller call (height, width, frames, num_images_per_prompt)"
        if self.phase.startswith("VAE decode"):
            return f"pipe.vae.enable_tiling() (--vae-tiling), {calls}, or another GPU for the VAE"
        if activations > self.memory:
            return f"{calls}: its activations alone take {format_bytes(activations)}; or a GPU with more memory"
        return (f"{calls}, --headroom measure (the plan keeps the {format_bytes(activations)} of activations free), "
                "or --strategy balanced_low_memory (weights onloaded at their call)")

    def __str__(self) -> str:
        by = f" in {self.component!r}" if self.component else ""
        slack = (f" (reserved {format_bytes(self.peak + self.slack)} with the allocator's slack)" if self.slack
                 else "")
        return (f"{self.device}: peak {format_bytes(self.peak)}{slack} is above its memory "
                f"{format_bytes(self.memory)}, set by {self.phase or 'the call'}{by}; try {self.advice()}")


@dataclass(frozen=True)
class SimulationReport:
    """The outcome of a dry run; byte figures are keyed by the plan's device names (``cuda:0``, not ``meta:0``).
    ``ok``: the call ran to its end; ``fits``: it ran and no device's peak passed its memory (``overruns`` names
    those that did); ``pipemap simulate`` exits 1 unless both."""

    ok: bool
    error: Failure | None
    peak_bytes: dict[str, int]
    weight_bytes: dict[str, int]
    activation_bytes: dict[str, int]
    plan: Plan
    seconds: float = 0.0
    call: dict = field(default_factory=dict)
    weight_peak_bytes: dict[str, int] = field(default_factory=dict)  # resident weights plus those onloaded at once
    peak_phase: dict[str, str] = field(default_factory=dict)  # the phase of the call that set each device's peak
    advice: tuple[str, ...] = ()  # what would make a peak that does not fit fit (VAE tiling)
    # devices whose peak is an upper bound, not exact, with the value the dry run had to assume (MoE routing)
    bound_peaks: dict[str, str] = field(default_factory=dict)
    # each device's memory over the call (``picture.Sample``s, at most TIMELINE_POINTS a device, peaks kept) and
    # the component running when each peak was set
    timeline: tuple = ()
    peak_component: dict[str, str] = field(default_factory=dict)
    # host copies left in their files (the disk tier): weights the run read through the files' maps, not RAM
    disk_bytes: int = 0

    @property
    def reserved_bytes(self) -> dict[str, int]:
        """Each device's peak as CUDA counts it: the bytes its caching allocator reserves, the peak allocated plus
        the slack of the stream pools the plan uses there (``modes.slack``: none on the CPU, or on a stand-in
        GPU under ``modes.SLACK_FROM``)."""
        memory = {d.device: d.memory for d in self.plan.devices}
        return {device: peak + slack(self.plan.components, device, memory.get(device, 0))
                for device, peak in self.peak_bytes.items()}

    @property
    def overruns(self) -> tuple[Overrun, ...]:
        """Each device whose reserved peak passed its memory, with what set the peak (the weights as
        ``weights_held``)."""
        memory = {d.device: d.memory for d in self.plan.devices}
        reserved = self.reserved_bytes
        return tuple(Overrun(device, peak, memory[device], self.peak_phase.get(device, ""),
                             self.peak_component.get(device, ""), self.weights_held(device), reserved[device] - peak)
                     for device, peak in self.peak_bytes.items()
                     if device in memory and reserved[device] > memory[device])

    @property
    def fits(self) -> bool:
        """Whether the call ran and every device's peak stayed within its memory."""
        return self.ok and not self.overruns

    @property
    def verdict(self) -> str:
        """``ok``, ``DOES NOT FIT`` (it ran, a peak passed its device's memory) or ``FAILED`` (it did not run)."""
        return "FAILED" if not self.ok else "ok" if self.fits else "DOES NOT FIT"

    def weights_held(self, device: str) -> int:
        """The table's weights on ``device``: the most weight bytes it held at once, as the memory ledger reserves
        them (``simulate_many``): what was there at the start and what hooks onloaded and kept, such as a streamed
        model's resident blocks, which are placed at its first call, and those in flight beside them."""
        return max(self.weight_bytes.get(device, 0), self.weight_peak_bytes.get(device, 0))

    def picture(self) -> Timeline:
        """Each device's memory over the call: the budget line, the peak marked with its phase and component
        (``report.picture().svg()``; ``pipemap simulate ... --svg run.svg``)."""
        budgets = {d.device: d.budget for d in self.plan.devices}
        title = f"pipemap dry run: {self.plan.strategy}" + {"ok": "", "FAILED": " (failed)"}.get(
            self.verdict, " (does not fit)")
        return Timeline(title, tuple(self.timeline), budgets, dict(self.peak_component))

    def _repr_html_(self) -> str:
        """What a notebook shows: the timeline picture, then the report's text."""
        return f"<div class='pipemap-simulation'>{self.picture().svg()}<pre>{escape(str(self))}</pre></div>"

    def __str__(self) -> str:
        lines = [f"dry run {self.verdict} in {self.seconds:.2f} s; call {self.call}"]
        if self.error:
            lines.append(f"error: {self.error}")
        lines.append(f"{'device':<10}{'weights':>12}{'activations':>13}{'peak':>12}{'memory':>12}  peak set by")
        memory = {d.device: d.memory for d in self.plan.devices}
        for device in self.peak_bytes:
            lines.append(f"{device:<10}{format_bytes(self.weights_held(device)):>12}"
                         f"{format_bytes(self.activation_bytes[device]):>13}"
                         f"{format_bytes(self.peak_bytes[device]):>12}{format_bytes(memory.get(device, 0)):>12}"
                         f"  {self.peak_phase.get(device, '')}{'  (bound)' if device in self.bound_peaks else ''}")
        if self.disk_bytes:
            host = self.plan.host
            lines.append(f"{'disk':<10}{format_bytes(self.disk_bytes):>12}{'':>13}{'':>12}"
                         f"{format_bytes(host.disk + host.kept):>12}  left in the files, read through their maps")
        for note in dict.fromkeys(self.bound_peaks.values()):
            lines.append(f"(bound): a peak at most this high; the dry run assumed {note}")
        lines += [f"does not fit: {over}" for over in self.overruns]
        return "\n".join(lines + list(self.advice))


def report_of(tracker, failure: Failure | None, plan: Plan, back: Mapping[str, str], seconds: float,
            call: dict) -> SimulationReport:
    def keyed(figures: Mapping[str, int]) -> dict[str, int]:
        out = {d.device: 0 for d in plan.devices if d.used or d.device in plan.device_map.values()}
        for device, value in figures.items():
            if device == DISK:
                continue
            name = back.get(device, device)
            out[name] = out.get(name, 0) + value
        return out

    peak, weights = keyed(tracker.peak), keyed(tracker.weights)
    weights = {d: weights.get(d, 0) for d in peak}
    weight_peak, activations = keyed(tracker.weight_peak), keyed(tracker.activation_peak)
    if failure is not None:
        failure = replace(failure, devices=tuple(back.get(d, d) for d in failure.devices))
    shown = {k: (v if not isinstance(v, torch.Generator) else "generator") for k, v in call.items()
             if not isinstance(v, torch.Tensor)}
    phases = {back.get(d, d): str(p) for d, p in tracker.peak_phase.items()}
    bound = {back.get(d, d): note for d, note in tracker.peak_bound.items()}
    timeline = _timeline(tracker.samples, back)
    who = {back.get(d, d): c for d, c in tracker.peak_component.items() if c}
    return SimulationReport(failure is None, failure, peak, weights, {d: activations.get(d, 0) for d in peak}, plan,
                            seconds, shown, {d: weight_peak.get(d, 0) for d in peak},
                            {d: phases[d] for d in peak if d in phases}, bound_peaks=bound, timeline=timeline,
                            peak_component=who, disk_bytes=tracker.weights.get(DISK, 0))


DISK = "disk"  # what the tracker counts the disk tier's host copies on (``StorageTracker.on_disk``)
TIMELINE_POINTS = 600  # a device's samples kept for the picture: the largest of each stretch, the peak among them


def _timeline(samples, back: Mapping[str, str]) -> tuple:
    by_device: dict[str, list[tuple[int, int, str]]] = {}
    for index, (device, size, phase) in enumerate(samples):
        if device == DISK:  # the files: no memory over the call
            continue
        by_device.setdefault(back.get(device, device), []).append((index, size, str(phase)))
    out = []
    for device, points in by_device.items():
        stretch = -(-len(points) // TIMELINE_POINTS)
        for start in range(0, len(points), stretch):
            index, size, phase = max(points[start:start + stretch], key=lambda p: p[1])
            out.append(Sample(index, device, size, phase))
    return tuple(sorted(out, key=lambda s: s.index))
