"""What a pipeline call asks of the hardware, counted by running it: each component's FLOPs, the bytes its kernels
read and write, and the kernels it launches, split into the work done once per image (prompt encoding, decoding)
and the work of one denoising step, so any number of steps is priced from one count.

The dry run counts them (``dryrun.counter``) at the call's own shapes; ``cost`` prices them. Plain values here, a
JSON round-trip for the catalog's record and the on-disk cache.

>>> tally = Tally(flops=2e12, bytes=3e9, memory_bytes=1e9, kernels=900)
>>> (tally + tally).kernels, tally.scaled(0.5).flops
(1800, 1000000000000.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

PIPELINE = "(pipeline)"  # the work of the pipeline's own code between components: the scheduler, guidance, latents


@dataclass(frozen=True)
class Tally:
    """Work of a run of kernels: ``flops`` (matrix products, convolutions, attention: torch's FLOP formulas), of
    which ``fp32_flops`` on float32 operands (an upcast VAE: half the tensor-core rate), ``bytes`` read and written by
    every kernel, ``memory_bytes`` the part of them moved by kernels that do no such FLOPs (normalisations,
    activations, copies: bound by memory bandwidth), and ``kernels`` launched. Of ``flops`` and ``bytes``, those of
    fused attention kernels: ``attention_flops`` and ``attention_bytes`` (queries, keys, values, mask and output:
    what a fused kernel reads and writes), and ``attention_scores``, the elements of the score matrices they never
    materialise (what PyTorch's math path would write and read instead): the cost model prices attention by the
    backend the user's stack runs."""

    flops: float = 0.0
    fp32_flops: float = 0.0
    bytes: float = 0.0
    memory_bytes: float = 0.0
    kernels: float = 0.0
    attention_flops: float = 0.0
    attention_bytes: float = 0.0
    attention_scores: float = 0.0

    def __add__(self, other: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(self.to_list(exact=True), other.to_list(exact=True))))

    def scaled(self, factor: float) -> Tally:
        return Tally(*(a * factor for a in self.to_list(exact=True)))

    def to_list(self, exact: bool = False) -> list[float]:
        values = [self.flops, self.fp32_flops, self.bytes, self.memory_bytes, self.kernels, self.attention_flops,
                  self.attention_bytes, self.attention_scores]
        return values if exact else [_round(v) for v in values]

    @classmethod
    def from_list(cls, values: list[float]) -> Tally:
        """A tally from ``to_list``'s form; a record from before attention was counted apart has five figures."""
        return cls(*(float(v) for v in values))


ZERO = Tally()


@dataclass(frozen=True)
class ComponentCounts:
    """One component's work for one image: ``once`` (outside the denoising loop), ``per_step`` (one denoising step:
    both calls of a true classifier-free guidance step, a batch of 2 in one call, or one call), the calls of each
    kind, and ``pieces``: the work of one call inside each module path (the innermost module running each kernel),
    for pricing a component streamed piece by piece."""

    component: str
    once: Tally = ZERO
    per_step: Tally = ZERO
    calls_once: float = 0.0
    calls_per_step: float = 0.0
    pieces: tuple[tuple[str, Tally], ...] = ()

    def total(self, steps: int) -> Tally:
        """The work of one image of ``steps`` denoising steps."""
        return self.once + self.per_step.scaled(steps)

    def calls(self, steps: int) -> float:
        """Calls of one image of ``steps`` steps."""
        return self.calls_once + self.calls_per_step * steps

    def per_call(self, steps: int) -> Tally:
        """The work of one call, on average."""
        calls = self.calls(steps)
        return self.total(steps).scaled(1.0 / calls) if calls else self.total(steps)

    def coarse(self, depth: int) -> ComponentCounts:
        """The same counts with ``pieces`` summed up to module paths of at most ``depth`` parts (a smaller record;
        the cost model shares a deeper piece's work out of its nearest counted module by bytes)."""
        table: dict[str, Tally] = {}
        for path, tally in self.pieces:
            key = ".".join(path.split(".")[:depth])
            table[key] = table.get(key, ZERO) + tally
        return replace(self, pieces=tuple(table.items()))

    def inside(self, path: str) -> Tally:
        """One call's work inside the module at ``path`` (and its children); ``""``: the whole call."""
        prefix = f"{path}." if path else ""
        found = ZERO
        for name, tally in self.pieces:
            if name == path or name.startswith(prefix):
                found = found + tally
        return found


@dataclass(frozen=True)
class Counts:
    """A pipeline call's work, counted at ``shape`` (the call's arguments that set its shapes: size, frames, images,
    guidance; steps apart), with ``steps`` the denoising steps the call runs. ``origin`` says how they were had: a
    dry run now, the on-disk cache, the catalog's record."""

    pipeline_class: str
    shape: tuple[tuple[str, str], ...]
    steps: int
    components: tuple[ComponentCounts, ...]
    dtype: str | None = None
    origin: str = "dry run"
    extra_steps: int = 0  # loop iterations beyond the steps asked for (PNDM's warm-up step)

    def iterations(self, steps: int | None = None) -> int:
        """The denoising loop's iterations for a call of ``steps`` steps (the call's own when None)."""
        return (self.steps if steps is None else steps) + self.extra_steps

    def __getitem__(self, component: str) -> ComponentCounts:
        for found in self.components:
            if found.component == component:
                return found
        raise KeyError(component)

    def get(self, component: str) -> ComponentCounts | None:
        return next((c for c in self.components if c.component == component), None)

    def total(self, steps: int | None = None) -> Tally:
        """The whole call's work at ``steps`` (the call's own when None)."""
        at = self.iterations(steps)
        found = ZERO
        for component in self.components:
            found = found + component.total(at)
        return found

    def coarse(self, depth: int) -> Counts:
        """These counts with every component's pieces summed up to paths of at most ``depth`` parts."""
        return replace(self, components=tuple(c.coarse(depth) for c in self.components))

    def to_dict(self) -> dict[str, Any]:
        return {"pipeline_class": self.pipeline_class, "shape": [list(p) for p in self.shape], "steps": self.steps,
                "extra_steps": self.extra_steps, "dtype": self.dtype,
                "components": {c.component: _component_dict(c) for c in self.components}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "recorded") -> Counts:
        components = tuple(_component_of(name, value) for name, value in data["components"].items())
        shape = tuple((str(k), str(v)) for k, v in data.get("shape", ()))
        return cls(data["pipeline_class"], shape, int(data["steps"]), components, data.get("dtype"), origin,
                   int(data.get("extra_steps", 0)))


def _component_dict(c: ComponentCounts) -> dict[str, Any]:
    return {"once": c.once.to_list(), "per_step": c.per_step.to_list(), "calls_once": c.calls_once,
            "calls_per_step": c.calls_per_step, "pieces": {p: t.to_list() for p, t in c.pieces}}


def _component_of(name: str, value: Mapping[str, Any]) -> ComponentCounts:
    pieces = tuple((str(p), Tally.from_list(t)) for p, t in value.get("pieces", {}).items())
    return ComponentCounts(name, Tally.from_list(value["once"]), Tally.from_list(value["per_step"]),
                           float(value["calls_once"]), float(value["calls_per_step"]), pieces)


def _round(value: float) -> float:
    """Four significant digits: a record stays small and diffs stay readable."""
    return float(f"{value:.4g}")


def shape_of(call: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The arguments of a call that set its work per step, as a sorted key: every argument but the step count,
    the generator and the output type; a tensor or image by its shape.

    >>> shape_of({"height": 512, "num_inference_steps": 30, "prompt": "a cat"})
    (('height', '512'), ('prompt', "'a cat'"))
    """
    skipped = {"num_inference_steps", "generator", "output_type", "return_dict", "callback_on_step_end"}
    return tuple(sorted((str(k), _describe(v)) for k, v in call.items() if k not in skipped))


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"<{type(value).__name__} {tuple(shape)} {getattr(value, 'dtype', '')}>"
    size = getattr(value, "size", None)
    if isinstance(size, tuple) and hasattr(value, "mode"):  # a PIL image
        return f"<image {size} {value.mode}>"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)
