"""The plan: where each component lives and how, as a frozen value you can print, compare and save.

Making a plan moves nothing; ``pipemap.dispatch`` and ``pipemap.load`` apply one.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from html import escape
from typing import TYPE_CHECKING, Any, Literal, overload

from .devices import is_accelerator, normalize_device, real_device
from .errors import PlanFormatError, UnknownDeviceError
from .modes import RANKS, TABLE, Mode, Peak, as_mode, device_use, facts, known, resolve_ranks, splits
from .picture import Picture, plan_picture
from .units import format_bytes

if TYPE_CHECKING:
    from rich.table import Table

    from .hardware import Performance

MODES = tuple(Mode)  # the built-in modes; ``modes.TABLE`` holds their facts (and a mode a test registers)


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
    everything else stays on ``device``, where its inputs and outputs live. ``"replicated"``: resident on ``device``
    with a whole copy on each of ``replicas``; each call's batch is split across them (``pipemap.dispatch.parallel``).
    ``"guidance"``: resident on ``device`` with a copy on ``replicas[0]``, which runs each step's second guidance
    branch while ``device`` runs the first (``hooks/guidance.py``). ``"sequence"``: resident on ``device`` with a
    copy on each of ``replicas``; each call's tokens are split across all of them (``hooks/sequence.py``).
    ``"guidance_sequence"``: both at once on 4 GPUs or more (``modes.branch_devices``): ``device`` and the first
    half of ``replicas`` split each step's first guidance call's tokens, the other half its second call's, started
    ahead as ``"guidance"`` starts it (``hooks/guidance_sequence.py``).

    A streamed component's pieces: ``blocks`` ((module path, bytes), ...), as fine as its room needs; of them
    ``resident_blocks`` (paths; ``""``: the tensors outside every piece) stay on its execution device,
    ``resident_bytes`` in all, and the rest cross the host link at each call, ``prefetch`` pieces fetched ahead of
    the running one. ``granularity``: how many times the deepest piece was cut below the top-level modules. Empty
    ``blocks``: the pieces are the component's top-level modules, none resident (plans made without a module tree).

    The host copy of an offloaded or streamed component (and of one computed on the CPU) lives in RAM, or stays in
    its safetensors ``files`` (memory-mapped: the disk tier), read from there at each call through a small pinned
    staging buffer: ``disk_blocks`` names a streamed component's pieces read so (``""``: its loose tensors),
    ``disk_bytes`` their bytes (for an offloaded component or one computed on the CPU: all of it, or 0). With
    ``files``, the pieces kept resident on a GPU keep no copy in RAM: a reset reads them back from the files.
    """

    component: str
    device: str
    bytes: int
    mode: str = Mode.RESIDENT
    execution_device: str = ""
    room: int = 0
    shards: tuple[tuple[str, str, int], ...] = ()
    blocks: tuple[tuple[str, int], ...] = ()
    resident_blocks: tuple[str, ...] = ()
    resident_bytes: int = 0
    prefetch: int = 0
    granularity: int = 0
    replicas: tuple[str, ...] = ()
    disk_blocks: tuple[str, ...] = ()
    disk_bytes: int = 0
    files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.execution_device:
            object.__setattr__(self, "execution_device", self.device)
        object.__setattr__(self, "mode", as_mode(self.mode))  # "offload" -> Mode.OFFLOAD: old code and JSON

    @property
    def ram_bytes(self) -> int:
        """Bytes of this component in CPU RAM: its host copy less what stays in its files (and, when it maps its
        files, less the pieces kept resident on its GPU)."""
        if self.device != "cpu":
            return 0
        kept = self.resident_bytes if _streamed(self) and self.files else 0
        return max(0, self.bytes - self.disk_bytes - kept)

    @property
    def pinned_bytes(self) -> int:
        """Of ``ram_bytes``, those page-locked for copies to a GPU: what crosses the host link at its calls."""
        if not facts(self.mode).moves_weights or not is_accelerator(self.execution_device):
            return 0
        return self.ram_bytes - (self.resident_bytes if _streamed(self) and not self.files else 0)


def _streamed(p: Placement) -> bool:
    return facts(p.mode).peak is Peak.STREAMED


def _mode_text(p: Placement) -> str:
    return facts(p.mode).text(p)


@dataclass(frozen=True)
class Candidate:
    """One plan ``"auto"`` weighed: its strategy, predicted seconds per image (None: it does not fit, and
    ``reason`` says why), each device's peak bytes, and the images per second of requests overlapped
    (``pipemap.run_many``: the busiest device's work per image sets the pace)."""

    strategy: str
    seconds: float | None
    peaks: tuple[tuple[str, int], ...]
    reason: str = ""
    images_per_second: float | None = None


@dataclass(frozen=True)
class DeviceUse:
    """A device's budget (its memory less the headroom kept for activations) and what the plan puts there."""

    device: str
    memory: int
    budget: int
    used: int


@dataclass(frozen=True)
class HostUse:
    """The CPU's RAM as a plan uses it, as a GPU's is shown: components computed on the CPU (``resident``), the
    host copies of offloaded and streamed ones in RAM, how much of that is page-locked (``pinned``, the
    ``staging`` buffers pieces read from the disk pass through included), the ``headroom`` kept free; and the bytes
    left in their files: ``disk``, read through their memory maps at each call, and ``kept``, pieces resident on a
    GPU whose only host copy is their files (a reset reads them back)."""

    resident: int
    offloaded: int
    streamed: int
    pinned: int
    staging: int
    disk: int
    headroom: int
    kept: int = 0
    files: int = 0

    def __str__(self) -> str:
        return (f"RAM: {format_bytes(self.resident)} resident, {format_bytes(self.offloaded)} offloaded, "
                f"{format_bytes(self.streamed)} streamed, {format_bytes(self.pinned)} pinned"
                + (f" ({format_bytes(self.staging)} staging)" if self.staging else "")
                + f"; headroom {format_bytes(self.headroom)}")


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
    staging: int = 0  # pinned host bytes that pieces read from the disk pass through on their way to a GPU
    # the speeds of the machine the plan was made for (``Hardware.performance``): what ``pipemap.estimate`` prices it
    # by unless given another machine. None: a plan made by hand, or saved before plans kept them. Not compared: two
    # plans are equal when they place alike, whatever the speeds they were priced at
    performance: Performance | None = field(default=None, compare=False)
    # what runs the other ranks of the plan's split denoiser (``modes.RANKS``: "process", "thread", "ray"); None for
    # a plan that splits nothing, or made by hand (decided at dispatch: ``PIPEMAP_WORKERS``, else processes).
    # ``ranks_asked``: named by the user (``ranks="process"``), so a model that cannot travel to a worker is an
    # error; chosen by ``ranks="auto"``, it falls back to threads at dispatch, with a warning
    ranks: str | None = None
    ranks_asked: bool = False

    @property
    def device_map(self) -> dict[str, str]:
        """``{component: device}`` as diffusers' ``hf_device_map`` has it."""
        return {p.component: p.device for p in self.components}

    @property
    def host(self) -> HostUse:
        """The CPU's RAM as this plan uses it (resident, offloaded, streamed, pinned, headroom) and the disk tier."""
        ram = {peak: sum(p.ram_bytes for p in self.components if facts(p.mode).peak is peak) for peak in Peak}
        cpu = next((d for d in self.devices if d.device == "cpu"), DeviceUse("cpu", 0, 0, 0))
        kept = sum(p.resident_bytes for p in self.components if _streamed(p) and p.files and p.device == "cpu")
        return HostUse(ram[Peak.HELD], ram[Peak.ONLOADED], ram[Peak.STREAMED],
                       sum(p.pinned_bytes for p in self.components) + self.staging, self.staging,
                       sum(p.disk_bytes for p in self.components), cpu.memory - cpu.budget, kept,
                       len({f for p in self.components if p.device == "cpu" for f in p.files}))

    def placement(self, component: str) -> Placement:
        for p in self.components:
            if p.component == component:
                return p
        raise KeyError(component)

    def with_components(self, components: tuple[Placement, ...], **changes: Any) -> Plan:
        """This plan with other placements (and any other ``changes``): each device's use moves by as much as its
        peak (``modes.device_use``) moves, so a figure set by hand keeps its offset; a device only the new
        placements use is added with no budget."""
        devices = tuple(replace(d, used=max(0, d.used + device_use(components, d.device)
                                            - device_use(self.components, d.device))) for d in self.devices)
        known_devices = {d.device for d in devices}
        new = dict.fromkeys(d for p in components for d in (p.device, p.execution_device, *p.replicas,
                                                             *(s[1] for s in p.shards)) if d not in known_devices)
        devices += tuple(DeviceUse(d, 0, 0, device_use(components, d)) for d in new)
        return replace(self, components=components, devices=devices, **changes)

    def remap(self, mapping: dict[str, str]) -> Plan:
        """The same plan on other devices, every mode kept: ``plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"})``."""
        move = {normalize_device(k): normalize_device(v) for k, v in mapping.items()}

        def dev(name: str) -> str:
            return move.get(name, name)

        components = tuple(replace(p, device=dev(p.device), execution_device=dev(p.execution_device),
                                   shards=tuple((path, dev(d), size) for path, d, size in p.shards),
                                   replicas=tuple(dev(d) for d in p.replicas))
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
        from rich.table import Table
        from rich.text import Text  # plain text: "[cuda:0]" or a component name is no rich markup

        table = Table(title=Text(f"pipemap plan: strategy {self.strategy!r}, execution device "
                                 f"{self.execution_device}" + (f", dtype {self.dtype}" if self.dtype else "")))
        for column in ("component", "device", "mode", "runs on", "bytes"):
            table.add_column(column, justify="right" if column == "bytes" else "left")
        for p in self.components:
            table.add_row(*map(Text, (p.component, p.device, _mode_text(p), p.execution_device, format_bytes(p.bytes))))
        table.add_section()
        for d in self.devices:
            table.add_row(*map(Text, (f"[{d.device}]", d.device, "total", "",
                                      f"{format_bytes(d.used)} of {format_bytes(d.budget)}")))
        host = self.host
        if any(p.ram_bytes for p in self.components) or host.staging or host.disk:
            table.add_row(*map(Text, ("[ram]", "cpu", str(host), "", "")))
        if host.disk or host.kept:
            # the bytes read from the files: the pieces kept on GPUs are counted there (in their device's total)
            table.add_row(*map(Text, ("[disk]", "disk", f"left in {host.files} file(s), memory-mapped: "
                                      f"{format_bytes(host.disk)} read at each call, {format_bytes(host.kept)} kept "
                                      "on GPUs", "", format_bytes(host.disk))))
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=100, color_system=None, force_terminal=False).print(self.table())
        return "\n".join([buffer.getvalue().rstrip(), *(f"note: {n}" for n in [*self.notes, *self._ranks_lines()])])

    def explain(self) -> str:
        """Why this plan: the candidates ``"auto"`` weighed, their predicted seconds per image, images per second
        with requests overlapped (``run_many``) and per-device peaks, and which won. Plans from a fixed strategy
        have no candidates and say so; what ``"parallel"`` did with the denoiser (its ``parallel:`` note: copies,
        split tokens, or why none) and how its copies exchange where the copy check staged a pair of their GPUs
        (``exchange:``) are said either way."""
        told = [n for n in self.notes if n.startswith(("auto:", "parallel:", "exchange:"))] + self._ranks_lines()
        if not self.candidates:
            return "\n".join([f"strategy {self.strategy!r} was asked for; no other plan was weighed", *told])
        ranked = sorted(self.candidates, key=lambda c: (c.seconds is None, c.seconds or 0.0))
        lines = [f"{'strategy':<34}{'s/image':>10}{'images/s':>10}  peaks per device"]
        for c in ranked:
            peaks = ", ".join(f"{d} {format_bytes(b)}" for d, b in c.peaks)
            figure = f"{c.seconds:>10.3g}" if c.seconds is not None else f"{'-':>10}"
            rate = f"{c.images_per_second:>10.3g}" if c.images_per_second is not None else f"{'-':>10}"
            lines.append(f"{c.strategy:<34}{figure}{rate}  {peaks or c.reason}")
        lines.append("s/image: one request at a time; images/s: requests overlapped (pipemap.run_many), paced by "
                     "the busiest device")
        return "\n".join(lines + told)

    def _ranks_lines(self) -> list[str]:
        """What runs each split's other ranks, and why (``ranks``)."""
        split = [p for p in self.components if splits(p)]
        if not split or self.ranks is None:
            return []
        how = {"process": "a worker process per GPU (its own GIL and CUDA streams; tensors over NCCL, gloo on the "
                          "CPU)",
               "thread": "threads of this process (one GIL)",
               "ray": "a worker process per GPU, as Ray actors in one placement group"}[self.ranks]
        why = ("asked for by name" if self.ranks_asked else
               "ranks='auto': worker processes wherever a plan splits a denoiser; a model that cannot travel to a "
               "worker, or a group that fails its bring-up check, runs on threads instead, with a warning")
        return [f"ranks: {p.component!r} on {', '.join((p.device, *p.replicas))}: {self.ranks}: {how} ({why})"
                for p in split]

    def picture(self, moved: Mapping[str, int] | None = None) -> Picture:
        """The plan drawn: each device a bar of its memory (``print(plan.picture())`` in a terminal,
        ``plan.picture().svg()`` for a file); ``moved`` maps components to bytes moved per image, for the links.
        See ``pipemap.picture``."""
        return plan_picture(self, moved)

    def _repr_html_(self) -> str:
        """What a notebook shows: the picture, then the table's notes."""
        notes = "".join(f"<li>{escape(n)}</li>" for n in self.notes)
        return f"<div class='pipemap-plan'>{self.picture().svg()}" + (f"<ul>{notes}</ul>" if notes else "") + "</div>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "execution_device": self.execution_device,
            "dtype": self.dtype,
            "variant": self.variant,
            "devices": {d.device: {"memory": d.memory, "budget": d.budget, "used": d.used} for d in self.devices},
            "components": {p.component: {"device": p.device, "mode": p.mode, "bytes": p.bytes,
                                         "execution_device": p.execution_device, "room": p.room,
                                         **({"shards": {path: {"device": d, "bytes": size} for path, d, size
                                                        in p.shards}} if p.shards else {}),
                                         **({"blocks": dict(p.blocks), "resident_blocks": list(p.resident_blocks),
                                             "resident_bytes": p.resident_bytes, "prefetch": p.prefetch,
                                             "granularity": p.granularity} if p.blocks else {}),
                                         **({"replicas": list(p.replicas)} if p.replicas else {}),
                                         **({"disk_blocks": list(p.disk_blocks), "disk_bytes": p.disk_bytes}
                                            if p.disk_bytes else {}),
                                         **({"files": list(p.files)} if p.files else {})}
                           for p in self.components},
            "notes": list(self.notes),
            **({"staging": self.staging} if self.staging else {}),
            **({"candidates": [{"strategy": c.strategy, "seconds": c.seconds, "peaks": dict(c.peaks),
                                "reason": c.reason, "images_per_second": c.images_per_second}
                               for c in self.candidates]} if self.candidates else {}),
            **({"performance": dataclasses.asdict(self.performance)} if self.performance is not None else {}),
            **({"ranks": self.ranks, "ranks_asked": self.ranks_asked} if self.ranks is not None else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """A plan from ``to_dict``'s form, checked as ``pipemap.plan`` checks its input (``PlanFormatError``)."""
        data = _mapping(data, "the plan")
        devices = tuple(DeviceUse(_device(name), _size(d, "memory", d.get("budget")), _size(d, "budget"),
                                  _size(d, "used")) for name, d in _items(data, "devices"))
        components = tuple(_placement(name, c) for name, c in _items(data, "components"))
        known = {d.device for d in devices}
        for p in components:
            for device in (p.device, p.execution_device, *(d for _, d, _ in p.shards), *p.replicas):
                if device not in known:
                    raise PlanFormatError(f"component {p.component!r} uses {device}, which is not among the "
                                          f"plan's devices ({', '.join(sorted(known))})")
        try:
            candidates = tuple(Candidate(c["strategy"], c["seconds"], tuple(c["peaks"].items()), c.get("reason", ""),
                                         c.get("images_per_second")) for c in data.get("candidates", ()))
        except (KeyError, TypeError, AttributeError) as err:
            raise PlanFormatError(f"the candidates are malformed ({type(err).__name__}: {err})") from None
        return cls(_text(data, "strategy"), components, devices, _device(_text(data, "execution_device")),
                   _text(data, "dtype", optional=True), _text(data, "variant", optional=True),
                   tuple(_strings(data.get("notes", []), "notes")), candidates, _size(data, "staging", 0),
                   _performance(data.get("performance")), *_ranks(data))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan saved by ``to_json``: ``Plan.from_json(Path("plan.json").read_text())``."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise PlanFormatError(f"from_json takes the JSON text, not a {type(text).__name__}")
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PlanFormatError(f"it is not valid JSON ({err})") from None
        return cls.from_dict(data)


# ---- checking a saved plan (PlanFormatError says what is wrong) ----------------------------------------------------


def _mapping(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PlanFormatError(f"{what} is a {type(value).__name__}, not a JSON object")
    return value


def _items(data: dict[str, Any], key: str) -> list[tuple[str, dict[str, Any]]]:
    if key not in data:
        raise PlanFormatError(f"the key {key!r} is missing")
    items = _mapping(data[key], repr(key)).items()
    if key == "components" and not items:
        raise PlanFormatError("it places no component")
    return [(_string(name, key), _mapping(value, f"{key}[{name!r}]")) for name, value in items]


def _string(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise PlanFormatError(f"{what}: {value!r} is not a name")
    return value


def _strings(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanFormatError(f"{what!r} is not a list of strings")
    return value


@overload
def _text(data: dict[str, Any], key: str, optional: Literal[False] = False) -> str:
    ...


@overload
def _text(data: dict[str, Any], key: str, optional: bool) -> str | None:
    ...


def _text(data: dict[str, Any], key: str, optional: bool = False) -> str | None:
    if key not in data and not optional:
        raise PlanFormatError(f"the key {key!r} is missing")
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise PlanFormatError(f"{key!r} is {value!r}, not a string")
    return value


def _size(data: dict[str, Any], key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise PlanFormatError(f"a {key!r} figure is missing in {data!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanFormatError(f"{key!r} is {value!r}, not a whole number of bytes")
    return value


def _device(name: object) -> str:
    try:
        return real_device(_string(name, "device"))
    except UnknownDeviceError as err:
        raise PlanFormatError(f"{name!r} {err.reason}") from None


def with_ranks(plan: Plan, ranks: object) -> Plan:
    """``plan`` with what runs its split's other ranks (``ranks=``, ``modes.resolve_ranks``); a plan that splits
    nothing keeps None."""
    if not any(splits(p) for p in plan.components):
        return replace(plan, ranks=None, ranks_asked=False)
    runtime, asked = resolve_ranks(ranks)
    return replace(plan, ranks=runtime, ranks_asked=asked)


def _ranks(data: Mapping[str, Any]) -> tuple[str | None, bool]:
    ranks, asked = data.get("ranks"), data.get("ranks_asked", False)
    if ranks is not None and ranks not in RANKS:
        raise PlanFormatError(f"ranks is {ranks!r}: one of {', '.join(RANKS)}, or left out")
    if not isinstance(asked, bool):
        raise PlanFormatError(f"ranks_asked is {asked!r}: true or false")
    return ranks, asked


def _performance(figures: object) -> Performance | None:
    """The saved machine's speeds; None where the plan was saved without them (before plans kept them). A figure
    this version does not know is left out, one it knows and lacks takes its default."""
    if figures is None:
        return None
    from .hardware import Performance  # here: reading a plan's figures needs the machine's module (torch)

    given = _mapping(figures, "'performance'")
    known = {f.name for f in dataclasses.fields(Performance)}
    try:
        return Performance(**{k: v for k, v in given.items() if k in known})
    except (ValueError, TypeError) as err:
        raise PlanFormatError(f"'performance' is malformed ({err})") from None


def _placement(name: str, c: dict[str, Any]) -> Placement:
    mode = c.get("mode", Mode.RESIDENT)
    if not known(mode):
        raise PlanFormatError(f"component {name!r} has mode {mode!r}; the modes are {', '.join(TABLE)}")
    shards = tuple((_string(path, "shard"), _device(_mapping(s, f"shard {path!r}").get("device")), _size(s, "bytes"))
                   for path, s in _mapping(c.get("shards", {}), f"{name!r} shards").items())
    if (mode == Mode.SPLIT) != bool(shards):
        raise PlanFormatError(f"component {name!r}: a split component, and only one, lists shards")
    execution = c.get("execution_device") or c.get("device")
    listed = _mapping(c.get("blocks", {}), f"{name!r} blocks")
    blocks = tuple((path, _size(listed, path)) for path in listed)
    return Placement(name, _device(c.get("device")), _size(c, "bytes"), mode, _device(execution), _size(c, "room", 0),
                     shards, blocks, tuple(_strings(c.get("resident_blocks", []), f"{name} resident_blocks")),
                     _size(c, "resident_bytes", 0), _size(c, "prefetch", 0), _size(c, "granularity", 0),
                     tuple(_device(d) for d in _strings(c.get("replicas", []), f"{name} replicas")),
                     tuple(_strings(c.get("disk_blocks", []), f"{name} disk_blocks")), _size(c, "disk_bytes", 0),
                     tuple(_strings(c.get("files", []), f"{name} files")))
