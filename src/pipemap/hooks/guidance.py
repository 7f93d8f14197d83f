"""Guidance branches at once (mode ``"guidance"``, strategy ``"parallel"``): a denoiser the pipeline calls once per
guidance branch (Wan, Qwen-Image's true CFG, Flux's true CFG: the conditional call, then the unconditional one, with
the same latents and timestep) runs the second call of each step on a copy on another GPU while the first runs on
its own GPU, without a change to the pipeline's code.

When a call arrives, the two calls before it tell what the next one will be: where the previous step's second call
differed from its first (the negative prompt's embeddings), the next call takes the previous second call's inputs;
everywhere else (latents, timestep) it takes this call's. That predicted call starts on the copy at once, and its
result is used only when the call that then arrives has exactly those inputs: the same tensor unmodified since
(identity and torch's version counter), else equal values; anything else is a miss, and the call runs as usual on the
denoiser's own GPU. So the outputs are the plain run's by construction (the same kernels on the same inputs); a miss
costs one wasted call on the copy. Each thread keeps its own calls (``pipemap.run_many`` interleaves requests).

The copy computes what the model was when it was made; anything besides the inputs that could make the two differ
turns the prediction off: the model changed since (a step callback that scales weights in place, swaps attention
processors or sets LoRA scales: ``changes``' signature of the model, with its modules' plain state, differs from the
one taken when the copy was made), or a diffusers cache on (FirstBlockCache and the others of ``enable_cache``:
their decisions hang on state that the pipeline's ``cache_context`` keeps on the home model only). Then each call
runs on the denoiser's own GPU, as plain; the copy is made again when ``pipemap.follow`` next sees the change.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..errors import PipemapError
from ..runtime.transfer import move
from .calls import version_of
from .changes import Signature, signature, unchanged
from .copies import CopiesHook

_MISSING = object()


@dataclass(frozen=True)
class Inputs:
    """One call's inputs, flattened: ``leaves`` (tensors and plain values) under ``spec``, and each tensor's version
    counter when they were read (None where torch keeps none: inference-mode tensors)."""

    spec: TreeSpec
    leaves: tuple
    versions: tuple

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Inputs:
        leaves, spec = tree_flatten((args, kwargs))
        return cls(spec, tuple(leaves), tuple(version_of(x) for x in leaves))

    @classmethod
    def started(cls, spec: TreeSpec, leaves: tuple) -> Inputs:
        """The inputs of a call started ahead: each tensor with its version counter now; a tensor without one
        (``torch.inference_mode``) copied, so that the call and the check of the call that arrives read the values
        it had now, whatever happens to it meanwhile."""
        versions = tuple(version_of(x) for x in leaves)
        kept = tuple(x.clone() if isinstance(x, torch.Tensor) and v is None else x for x, v in zip(leaves, versions))
        return cls(spec, kept, versions)


@dataclass
class Branches:
    """One thread's recent calls of the denoiser, and the call started ahead on the copy."""

    history: deque = field(default_factory=lambda: deque(maxlen=2))
    ahead: tuple[Inputs, Any] | None = None  # the inputs and the ``ranks.Pending`` of the call started ahead
    compared: dict = field(default_factory=dict)  # two tensors' values compared, by identity and version (``predict``)
    missed: int = 0  # calls started ahead and missed, in a row
    rest: int = 0  # predicted calls to let pass before the next start ahead (after ``BACKOFF_AFTER`` misses)


BACKOFF_AFTER = 3  # misses in a row after which the copy starts calls ahead only now and then
BACKOFF_MOST = 8  # the most predicted calls let pass between two tries (at worst a ninth of the steps wasted)


class GuidanceHook(CopiesHook):
    """A denoiser on ``device`` with a copy on ``replicas[0]``, which runs each step's second call ahead of time.

    ``hits`` and ``misses`` count the calls started ahead that were used and those that were not. After
    ``BACKOFF_AFTER`` misses in a row (a pipeline whose second call a step is not what the last step's was), the copy
    lets 1, 2, 4, ... (at most ``BACKOFF_MOST``) predicted calls pass between two tries, so a copy that misses every
    call stops computing for nothing; a hit starts every call ahead again. ``held_back`` counts the calls let pass,
    and ``pipemap.stats`` says so (``ahead_report``).
    """

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...],
                 runtime: str = "thread", asked: bool = False):
        super().__init__(component, device, execution_device, replicas, runtime, asked)
        self.hits = self.misses = self.held_back = 0
        self._threads: dict[int, Branches] = {}
        self._home: torch.nn.Module | None = None
        self._made: Signature | None = None  # the model's signature when the copy was made from it

    @staticmethod
    def copied(replicas: tuple[str, ...]) -> tuple[str, ...]:
        """The devices of ``replicas`` this hook keeps a copy on: the first (the second branch's)."""
        return replicas[:1]

    def init_hook(self, module):
        module = super().init_hook(module)
        self._home, self._made = module, signature(module, state=True)
        return module

    def detach_hook(self, module):
        module = super().detach_hook(module)
        self._threads, self._home, self._made = {}, None, None
        return module

    def copy_is_current(self) -> bool:
        """Whether the copy computes what the home model would: the model unchanged since the copy was made, and
        no diffusers cache on (its state lives on the home model)."""
        home = self._home
        if home is None or getattr(home, "_cache_config", None) is not None:
            return False
        # follow's change counter and version sum first (a fraction of a ms); the whole signature (tens of ms on a
        # Flux-sized model) only when either moved
        return unchanged(home) or signature(home, state=True) == self._made

    def run(self, *args, **kwargs):
        inputs = Inputs.of(args, kwargs)
        branches = self._threads.setdefault(threading.get_ident(), Branches())
        result = self._taken(branches, inputs)
        if result is _MISSING:
            upcoming = predict(tuple(branches.history), inputs, branches.compared)
            # asked once a step, before a call starts ahead (a step callback runs between steps, after the call
            # started ahead was taken): a model walked whole, a few ms for a Flux-sized one
            if upcoming is not None and self._may_start(branches) and self.copy_is_current():
                branches.ahead = (upcoming, self._start(upcoming))
            result = self.forward_own(*args, **kwargs)
        branches.history.append(inputs)
        return result

    def _taken(self, branches: Branches, inputs: Inputs):
        """The result of the call started ahead if this call's inputs are exactly its inputs, else ``_MISSING``."""
        if branches.ahead is None:
            return _MISSING
        (started, pending), branches.ahead = branches.ahead, None
        if started.spec == inputs.spec and all(same(started, inputs, i) for i in range(len(inputs.leaves))):
            try:
                result = move(pending.result()[0], self.device)  # copied home here, where it is used (G2)
            except Exception:  # the copy failed (its GPU out of memory): the call runs as usual
                return self._missed(branches)
            self.hits, branches.missed = self.hits + 1, 0
            return result
        return self._missed(branches)

    def _missed(self, branches: Branches) -> Any:
        self.misses += 1
        branches.missed += 1
        if branches.missed >= BACKOFF_AFTER:
            branches.rest = min(2 ** (branches.missed - BACKOFF_AFTER), BACKOFF_MOST)
        return _MISSING

    def _may_start(self, branches: Branches) -> bool:
        """Whether a predicted call starts ahead now, or is let pass (after misses in a row)."""
        if branches.rest:
            branches.rest -= 1
            self.held_back += 1
            return False
        return True

    def ahead_report(self) -> dict[str, Any]:
        """The calls started ahead, as ``pipemap.stats`` reports them."""
        report: dict[str, Any] = {"ahead_hits": self.hits, "ahead_misses": self.misses}
        if self.held_back:
            report["ahead_held_back"] = self.held_back
            report["ahead_note"] = (
                f"{self.held_back} predicted calls were not started ahead: the copy's calls missed {BACKOFF_AFTER} "
                "in a row (the second call of a step was not what the step before's was, or none came), so it "
                f"tries again only after 1, 2, 4, ... (at most {BACKOFF_MOST}) calls, and at every call after a hit")
        return report

    def _start(self, upcoming: Inputs) -> Any:  # a ``ranks.Pending``
        """The call ``upcoming`` started on the copy's rank (a worker that is gone: a miss, the call runs here)."""
        inputs = tree_unflatten(list(upcoming.leaves), upcoming.spec)
        try:
            return self.live_ranks().submit([inputs])
        except PipemapError as err:  # the worker gone (stopped): this branch runs here, the next call starts anew
            return Failed(err)

    def __getstate__(self):
        return {**super().__getstate__(), "_threads": {}, "_home": None}


class Failed:
    """A call that could not be started ahead: a miss, its error kept for whoever asks."""

    def __init__(self, error: Exception):
        self.error = error

    def result(self) -> list:
        raise self.error


def predict(history: tuple[Inputs, ...], arriving: Inputs, compared: dict | None = None) -> Inputs | None:
    """The call expected after ``arriving``, from the two calls before it: where the second of them differed from the
    first, the second's inputs; elsewhere ``arriving``'s. None unless ``arriving`` is a first branch: shaped as
    both, and equal to the first of them wherever the two differed (so the latents moved on, the prompt did not).
    Two calls alike (a negative prompt that encodes as the prompt does) predict a call alike too. ``compared``: the
    values of two tensors compared before, unchanged since (the prompt's and the negative prompt's embeddings, every
    step), answered from there: a comparison of values makes the host wait for the GPU."""
    if len(history) < 2:
        return None
    first, second = history
    if not first.spec == second.spec == arriving.spec:
        return None
    # a guess: the call started from it is checked when the next call arrives (``same``)
    differ = [i for i in range(len(first.leaves)) if not _alike_kept(first.leaves[i], second.leaves[i], compared)]
    if not all(alike(first.leaves[i], arriving.leaves[i]) for i in differ):
        return None
    return Inputs.started(arriving.spec, tuple(second.leaves[i] if i in differ else x
                                               for i, x in enumerate(arriving.leaves)))


def _alike_kept(x, y, compared: dict | None) -> bool:
    """``alike``, remembered in ``compared`` for two tensors by identity and version (they are kept there, so their
    identities stay theirs)."""
    if compared is None or x is y or not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return alike(x, y)
    versions = (version_of(x), version_of(y))
    if None in versions:
        return alike(x, y)
    key = (id(x), id(y), versions)
    kept = compared.get(key)
    if kept is None:
        if len(compared) >= 16:  # a few pairs a call: old ones (last request's embeddings) go
            compared.clear()
        kept = compared[key] = (x, y, alike(x, y))
    return kept[2]


def same(started: Inputs, arriving: Inputs, i: int) -> bool:
    """Whether leaf ``i`` of the call that arrives holds exactly what the call started ahead read: the same tensor
    unmodified since (its version counter), or equal values; equal plain values."""
    x, y = started.leaves[i], arriving.leaves[i]
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return alike(x, y)
    if started.versions[i] is not None:  # else ``x`` is a copy of what was read (``Inputs.started``)
        if version_of(x) != started.versions[i]:
            return False  # changed since it was read
        if x is y:
            return True
    return _equal_tensors(x, y)


def alike(x, y) -> bool:
    """The same object, or equal values (tensors of one shape, dtype and device)."""
    if x is y:
        return True
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return _equal_tensors(x, y)
    if type(x) is not type(y) or isinstance(x, torch.Tensor):
        return False
    try:
        return bool(x == y)
    except Exception:
        return False


def _equal_tensors(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        return False
    try:
        return bool(torch.equal(x, y))
    except Exception:  # values a dry run's fake tensors do not have: not known to be equal
        return False
