"""The verbs: ``plan``, ``inspect``, ``load``, ``simulate``, ``simulate_many`` and ``estimate``, each built on one
frozen, validated ``Request`` (the source and what a user asks of it: hardware, strategy, dtype, variant, headroom,
max_memory, the call a dry run measures). The command line, the demo and serve build a ``Request`` and nothing else,
so an argument means the same wherever it is given.

The planner below keeps the pure strategies; the measured headroom (a plan whose reservations a dry run measured) is
composed here, above the planner and the dry run, so neither imports the other. So is the memory ledger of a placed
pipeline (``memory_for``): the runtime's rule, fed by the dry run's figures at each call's shape; ``run_many`` and
``iter_many`` here are the runtime's, admitted by it.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .cost import launch_bound, predict, workload_for
from .devices import is_accelerator, real_device
from .dispatch import planned
from .dispatch.loading import check_passed, check_plan_fits, check_plan_models, load_onto, with_passed
from .errors import (
    ArgumentConflictError,
    ArgumentTypeError,
    HeadroomError,
    PipelineMappedError,
    SimulationFailedError,
    UnknownStrategyError,
)
from .hardware import Hardware, gpu_names
from .hooks import give_back_kept, kept_bytes
from .inventory import inventory_of
from .inventory.files import check_weights_present
from .inventory.folder import read_model_index
from .inventory.values import Inventory, resolve_dtype
from .modes import AUTO_RANKS, facts, resolve_ranks
from .plan import Plan, with_ranks
from .planner import AUTO, MIXED, STRATEGIES, budgets, check_headroom, plan_inventory
from .runtime.admission import Admission, cuda_peaks, shared_ledger
from .runtime.placed import admission_of, keep_admission
from .units import format_bytes, parse_bytes

# The dry run, the catalog, the cost model, the memory ledger and run_many are imported by the verbs that use them,
# not here: ``pipemap.load``'s first call in a process then imports only what loading and placing need (issue 28).
if TYPE_CHECKING:
    from .cost import Cost, Workload
    from .counts import Counts
    from .dryrun.many import ManyReport
    from .dryrun.report import SimulationReport
    from .runtime.admission import Admission

MEASURE = "measure"  # the headroom a dry run measures


# the strategies that price a call: ``call=`` tells them which (a negative prompt, a size) without a dry run
PRICED_FOR_CALL = (AUTO, "parallel")


@dataclass(frozen=True)
class Request:
    """What a user asks of pipemap, checked once: the ``source`` (a pipeline folder, a catalog name, an
    ``Inventory`` or a loaded pipeline) and the settings every verb reads the same way.

    ``strategy`` is None when none was given (``"balanced"`` then plans; a saved plan is not contradicted);
    ``hardware`` is None for this machine (detected when first needed); ``dtype`` is a ``torch.dtype`` or None;
    ``headroom`` is what ``budgets`` takes, or ``"measure"``; ``call`` is the call a measuring dry run makes, or the
    call ``"auto"`` and ``"parallel"`` plan for (priced without a dry run: ``cost.workload_for``).

    >>> request = Request.of("path/to/sdxl", hardware="2x16GiB", strategy="auto", dtype="float16")  # doctest: +SKIP
    >>> print(request.plan())                                                                       # doctest: +SKIP
    """

    source: object
    hardware: Hardware | None = None
    strategy: str | dict | None = None
    max_memory: Mapping | None = None
    dtype: torch.dtype | None = None
    variant: str | None = None
    headroom: object = None
    call: Mapping = field(default_factory=dict)
    ranks: object = AUTO_RANKS  # what runs a split's other ranks (``modes.RANKS``, or "auto"): checked in ``of``

    @classmethod
    def of(cls, source, hardware: Hardware | str | None = None, strategy: str | Mapping | None = None,
           max_memory: Mapping | None = None, dtype=None, variant: str | None = None, headroom=None, *,
           device_map: str | Mapping | None = None, torch_dtype=None, call: Mapping | None = None,
           ranks: object = AUTO_RANKS) -> Request:
        """The request these arguments make, each checked (a typed error naming the argument and the fix); nothing
        is read from disk and no device is probed."""
        resolve_ranks(ranks)
        chosen = resolve_strategy(strategy, device_map) if strategy is not None or device_map is not None else None
        machine = _hardware(hardware, max_memory)
        target = resolve_dtype(dtype, torch_dtype)
        if variant is not None and not isinstance(variant, str):
            raise ArgumentTypeError("variant", variant, "a string such as 'fp16', or None")
        measured = isinstance(headroom, str) and headroom.strip() == MEASURE
        if not measured:
            check_headroom(headroom)
        if call is not None and not measured and chosen not in PRICED_FOR_CALL:
            raise ArgumentConflictError("call", call, "headroom", headroom, "call= is the call a dry run measures, "
                                        "or the call strategy 'auto' or 'parallel' plans for: pass "
                                        "headroom='measure' or one of those strategies with it, or drop it")
        if call is not None and not isinstance(call, Mapping):
            raise ArgumentTypeError("call", call, "a dict of keyword arguments for the pipeline call")
        return cls(source, machine, chosen, dict(max_memory) if max_memory else None, target, variant,
                   MEASURE if measured else headroom, dict(call or {}), ranks)

    @property
    def measured(self) -> bool:
        """Whether the headroom is what a dry run measures."""
        return self.headroom == MEASURE

    def machine(self) -> Hardware:
        """The hardware to plan for (this machine's when none was given), less ``max_memory``."""
        hw = self.hardware or _with_kept(Hardware.detect())
        return hw.with_max_memory(self.max_memory) if self.max_memory else hw

    def inventory(self) -> Inventory:
        """The source's components, sized at the dtype asked for: headers only for a folder, configs only for a
        catalog name."""
        source = self.source
        if isinstance(source, str) and not os.path.exists(source):
            from . import catalog  # here: only a name that is no path is looked up there

            if catalog.resolve(source) is not None:
                return catalog.inventory(source, self.dtype)
            raise catalog.unknown(source)  # no folder, no name: the nearest names
        return inventory_of(source, self.dtype, self.variant)

    def plan(self, inventory: Inventory | None = None) -> Plan:
        """The plan this request asks for (of ``inventory`` when given: a folder's with passed components)."""
        hw = self.machine()
        inventory = inventory or self.inventory()
        strategy = self.strategy if self.strategy is not None else "balanced"
        if self.measured:
            made = measured_plan(self.source, inventory, hw, strategy, self.call)
        else:
            counts = self.known_counts(inventory) if strategy == AUTO else None
            work = workload_for(inventory, self.call) if self.call else None
            made = plan_inventory(inventory, hw, strategy, budgets(hw, self.headroom), counts, work,
                                  resolve_ranks(self.ranks)[0])
        return with_ranks(made, self.ranks)

    def known_counts(self, inventory: Inventory) -> Counts | None:
        """The default call's counted work, if known without a dry run (the catalog's record, this process, the
        disk cache): what ``"auto"`` prices its candidates by."""
        from .dryrun.counted import known_counts  # here: only "auto" prices by counts

        return known_counts(self.source, inventory.dtype, self.call)


def plan(source, hardware: Hardware | str | None = None, strategy: str | Mapping | None = None,
         max_memory: Mapping | None = None, dtype=None, variant: str | None = None, headroom=None, *,
         device_map: str | Mapping | None = None, torch_dtype=None, call: Mapping | None = None,
         ranks: str = AUTO_RANKS) -> Plan:
    """Where each component of a pipeline goes, before anything is loaded.

    ``source`` is a pipeline folder (only headers are read), a catalog name (``pipemap catalog``), an
    ``Inventory`` or a loaded pipeline. ``strategy`` (or diffusers' name for it, ``device_map``) is one of
    ``pipemap.STRATEGIES``, ``"auto"`` (the fastest that fits), or a dict ``{component: device}`` whose missing
    components are placed by ``"balanced"``. ``headroom`` is kept free on each GPU for activations: a fraction
    (``0.1``, ``"0.1"``), bytes (an int, ``"2GiB"``), a dict per device, or ``"measure"``: the activation peak a dry
    run of the pipeline's default call measures (``call=`` gives another call, e.g. a ControlNet image), re-planned
    until the reservation is stable. With ``"auto"`` or ``"parallel"``, ``call=`` is also the call they plan for
    (``{"negative_prompt": " "}``: Qwen-Image's true CFG, two denoiser calls a step), priced without a dry run.
    ``ranks`` is what runs the other ranks of a denoiser split across GPUs (the modes of ``strategy="parallel"``):
    ``"auto"`` (``PIPEMAP_WORKERS`` where set, else worker processes), ``"process"`` (a worker process per GPU),
    ``"thread"`` (threads of this process) or ``"ray"`` (Ray actors); the plan keeps it (``plan.ranks``,
    ``plan.explain()``).

    >>> plan = pipemap.plan("path/to/sdxl", hardware="2x16GiB,cpu=64GiB", strategy={"vae": "cuda:1"},
    ...                     dtype=torch.float16, variant="fp16")                         # doctest: +SKIP
    >>> print(plan)                                                                    # doctest: +SKIP
    """
    return Request.of(source, hardware, strategy, max_memory, dtype, variant, headroom, device_map=device_map,
                      torch_dtype=torch_dtype, call=call, ranks=ranks).plan()


def inspect(source, dtype=None, variant: str | None = None, *, torch_dtype=None) -> Inventory:
    """The components of a pipeline folder (headers only, no weight read), a published pipeline's name
    (``"flux.1-dev"``, sized by the catalog from its configs, nothing downloaded) or a loaded pipeline.

    >>> inv = pipemap.inspect("path/to/sdxl", dtype=torch.float16, variant="fp16")   # doctest: +SKIP
    >>> [c.name for c in inv.models]                                                 # doctest: +SKIP
    ['text_encoder', 'text_encoder_2', 'unet', 'vae']
    """
    return Request.of(source, dtype=dtype, variant=variant, torch_dtype=torch_dtype).inventory()


def load(path, plan: Plan | None = None, strategy=None, hardware: Hardware | str | None = None, max_memory=None,
         dtype=None, variant: str | None = None, headroom=None, *, device_map=None, torch_dtype=None,
         progress: bool = True, check_transfers: bool = True, ranks: str | None = None, **kwargs):
    """Load a pipeline folder onto its plan and return the dispatched pipeline.

    Keyword arguments that name a component (``controlnet=...``) pass that component in already built: it is
    sized, placed and hooked like the rest. Other keyword arguments go to ``DiffusionPipeline.from_pretrained``.
    Without ``plan``, the other arguments make one as ``pipemap.plan`` does (``headroom="measure"`` included);
    ``ranks`` (as ``pipemap.plan`` takes it) overrides a given plan's.

    >>> pipe = pipemap.load("path/to/sdxl", device_map="balanced", max_memory={0: "20GiB", 1: "20GiB"},
    ...                     dtype=torch.float16, variant="fp16")                        # doctest: +SKIP
    >>> pipe.hf_device_map                                                              # doctest: +SKIP
    {'text_encoder': 'cuda:1', 'text_encoder_2': 'cuda:1', 'unet': 'cuda:0', 'vae': 'cuda:1'}
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError("path", path, "a pipeline folder (a str or a Path)")
    if plan is not None and not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns, or None")
    folder = Path(path)
    index = read_model_index(folder)
    request = Request.of(str(folder), hardware, strategy, max_memory, dtype, variant, headroom,
                         device_map=device_map, torch_dtype=torch_dtype, ranks=AUTO_RANKS if ranks is None else ranks)
    if plan is not None:
        check_plan_arguments(plan, request)
        plan = with_ranks(plan, ranks) if ranks is not None else plan
    passed = {k: kwargs.pop(k) for k in list(kwargs) if k in index and not k.startswith("_")}
    check_passed(index, passed)
    inventory = with_passed(request.inventory(), passed)  # headers only: checks before any load
    if plan is None:
        plan = request.plan(inventory)
    check_weights_present(folder, index, request.variant if request.variant is not None else plan.variant, passed,
                          inventory)
    running = runnable(plan)  # as the command line runs it: GPUs this machine lacks on the CPU, and said so
    check_plan_fits(running, inventory)
    if running is not plan:
        warnings.warn(f"pipemap: this machine lacks {', '.join(_lacking(plan, running))} of the plan: running the "
                      "same plan with them on the CPU (plan for this machine, or leave hardware= out, to use what it "
                      "has)", UserWarning, stacklevel=2)
    give_back_kept()  # the plan counted what placed pipelines keep onloaded as free: its weights go there now
    return load_onto(folder, index, running, passed, request.dtype, request.variant, progress=progress,
                     check_transfers=check_transfers, kwargs=kwargs)


def simulate(source, plan: Plan, *, steps: int = 2, vae_tiling: bool = False, advice: bool = True,
             **call_kwargs) -> SimulationReport:
    """Run ``source``'s own call on stand-in devices as ``plan`` places it; never touches the caller's pipeline.

    ``source`` is a loaded pipeline, a pipeline folder (no weight byte is read) or a catalog name such as
    ``"flux.1-dev"`` (models built from its published configs; nothing is downloaded). Steps repeat, so ``steps``
    (default 2) need not be the real count. ``vae_tiling=True`` calls ``vae.enable_tiling()`` first. Where VAE
    decode peaks above its device's memory, the report's ``advice`` says whether tiling would fit, from a second dry
    run with tiling; ``advice=False`` skips it (half the time). ``report.ok`` says the call ran; ``report.fits`` that
    it ran and every device's peak stayed within its memory (``report.overruns``: each device it did not, with what
    set the peak and what would help). Extra keyword arguments go to the pipeline call
    (``height=``, ``width=``, ``image=`` for a ControlNet, ``output_type=``...).

    >>> plan = pipemap.plan("flux.1-dev", hardware="2x16GiB", strategy="auto")          # doctest: +SKIP
    >>> report = pipemap.simulate("flux.1-dev", plan, height=1024, width=1024)         # doctest: +SKIP
    >>> report.fits, report.peak_bytes["cuda:0"], report.peak_phase["cuda:0"]          # doctest: +SKIP
    (True, 15301233664, 'denoising (step 1)')
    """
    if not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ArgumentTypeError("steps", steps, "a whole number of denoising steps, 1 or more (2 shows the peak)")
    if not isinstance(advice, bool):
        raise ArgumentTypeError("advice", advice, "True (the default: tiling advice where VAE decode does not fit) "
                                "or False (no second dry run)")
    check_plan_of(source, plan)
    from .dryrun.run import simulate as dry_run  # here, as each dry-run verb imports it: load needs none

    return dry_run(source, plan, steps=steps, vae_tiling=vae_tiling, advice=advice, **call_kwargs)


def simulate_many(source, plan: Plan, calls, workers: int = 2, *, steps: int = 2) -> ManyReport:
    """The dry run of ``run_many(pipe, calls, workers)``: each call shape run once on stand-in devices, then the
    calls run together under the memory rule a real run uses; each device's peak with the requests overlapped, how
    many ran at once, and the calls too large for the plan refused with their figures.

    >>> plan = pipemap.plan("flux.1-dev", hardware="2x16GiB", strategy="auto")                    # doctest: +SKIP
    >>> calls = [{"prompt": "a cat", "height": 1024, "width": 1024}] * 4
    >>> report = pipemap.simulate_many("flux.1-dev", plan, calls, workers=2)                      # doctest: +SKIP
    >>> report.peak_bytes, report.most_in_flight, report.refused                                  # doctest: +SKIP
    """
    if not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ArgumentTypeError("workers", workers, "a whole number of requests in flight, at least 1")
    calls = list(calls)
    if not all(isinstance(c, Mapping) for c in calls):
        raise ArgumentTypeError("calls", calls, "a list of dicts of the pipeline's keyword arguments")
    check_plan_of(source, plan)
    from .dryrun.many import simulate_many as dry_run_many

    return dry_run_many(source, plan, calls, workers, steps=steps)


def check_plan_of(source, plan: Plan) -> None:
    """A plan made for another pipeline than ``source`` (a loaded pipeline, a folder or a catalog name) is a
    ``PlanMismatchError`` before a dry run builds anything, as ``load`` refuses it."""
    if isinstance(getattr(source, "components", None), dict):
        models = {n for n, m in source.components.items() if isinstance(m, torch.nn.Module)}
        return check_plan_models(plan, models, "pipeline")
    if isinstance(source, str) and not os.path.exists(source):
        from . import catalog  # here: only a name that is no path is looked up there

        if (name := catalog.resolve(source)) is not None:
            return check_plan_models(plan, set(catalog.entry(name).configs), f"pipeline {name!r}")
    if isinstance(source, (str, os.PathLike)):
        check_plan_models(plan, {c.name for c in inventory_of(source, plan.dtype, plan.variant).models}, "folder")
    return None


def memory_for(pipe, plan: Plan | None = None, *, source=None) -> Admission | None:
    """The memory ledger ``run_many`` and serve admit ``pipe``'s requests by, made once per placement: each call
    shape measured by a dry run of ``source`` (the pipeline itself, copied with no weight; or its folder, which a
    pipeline with offloaded or streamed components needs), over the devices of ``plan`` (the pipeline's own, or the
    plan it was remapped from). None when the pipeline is not placed or ``plan`` has no GPU.

    >>> admission = pipemap.api.memory_for(pipe)                                                  # doctest: +SKIP
    >>> print(admission.describe())                                                               # doctest: +SKIP
    """
    running = planned(pipe) if isinstance(getattr(pipe, "components", None), dict) else None
    if plan is not None and not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "the pipemap.Plan the pipeline was placed by (or remapped from)")
    if running is None:
        return None
    counted = plan or running
    if not any(is_accelerator(d.device) for d in counted.devices):
        return None
    found = admission_of(pipe)
    if found is not None and found.running is running and found.asked == plan:
        return found
    from .dispatch.relief import relieve

    # one ledger for the placed pipelines of this process: two on one GPU never exceed it together (issue 39)
    pipe_ref, kept = weakref.ref(pipe), threading.Event()
    admission = Admission(counted, _measure(source, pipe, running), running=running,
                          relieve=functools.partial(relieve, pipe),
                          allocator=cuda_peaks(counted, running), ledger=shared_ledger(),
                          alive=lambda: not kept.is_set() or _admits(pipe_ref, admission))
    admission.asked = plan
    keep_admission(pipe, admission)
    kept.set()
    return admission


def _admits(pipe_ref: weakref.ref, admission: Admission) -> bool:
    """Whether ``admission`` is still its pipeline's (not reset, replaced or collected)."""
    pipe = pipe_ref()
    return pipe is not None and admission_of(pipe) is admission


def call_needs(source, plan: Plan, call: dict):
    """What one call of ``source`` (a folder, a catalog name or a pipeline) needs on each device of ``plan``: the
    dry run's figures the memory ledger admits requests by (``dryrun.many.needs_of``)."""
    from .dryrun.many import needs_of

    return needs_of(source, plan, call)


def _measure(source, pipe, running: Plan):
    """The ledger's measure: a dry run of ``source``, else of what ``_dry_run_source`` finds now (a copy taken at
    once, before later changes to the pipeline). A pipeline with nothing to dry-run from (streamed, built in code)
    raises at each measure instead, and the ledger runs its requests alone, with a warning, rather than
    ``run_many`` refusing them."""
    failure: PipelineMappedError | None = None
    if source is None:
        try:
            source = _dry_run_source(pipe, running)
        except PipelineMappedError as err:
            failure = err

    def measure(plan: Plan, call: dict):
        if failure is not None:
            raise failure
        return call_needs(source, plan, call)

    return measure


def _dry_run_source(pipe, running: Plan):
    """What a placed pipeline's dry runs start from: a weightless copy of it, or its folder when it has offloaded
    or streamed components (their hooks hold the weights' masters, which no copy can share)."""
    if all(facts(p.mode).weightless_copy for p in running.components):
        from .dryrun.many import snapshot

        return snapshot(pipe)
    folder = getattr(getattr(pipe, "config", None), "_name_or_path", None)
    if folder and (Path(folder) / "model_index.json").is_file():
        return str(folder)
    raise PipelineMappedError("measuring the memory of a pipeline with offloaded or streamed components that was "
                              "not loaded from a folder (give source= its folder)")


def run_many(pipe, calls, workers: int = 2, *, return_exceptions: bool = False, plan: Plan | None = None) -> list:
    """Run the pipeline once per keyword dict of ``calls``, results in order, at most ``workers`` requests in flight
    and as many as memory allows: a request starts only when its activations (a dry run at its own shape, cached)
    fit beside the plan's weights and the running requests on every device it touches; a call too large for the
    plan fails with ``CallTooLargeError``. ``plan``: the plan the pipeline was remapped from, when it runs on other
    devices (tests on the CPU). See ``parallel.iter_many``.

    >>> calls = [{"prompt": p, "generator": torch.Generator().manual_seed(i)} for i, p in enumerate(prompts)]
    >>> images = [out.images[0] for out in pipemap.run_many(pipe, calls, workers=4)]          # doctest: +SKIP
    """
    return list(iter_many(pipe, calls, workers, return_exceptions=return_exceptions, plan=plan))


def iter_many(pipe, calls, workers: int = 2, *, return_exceptions: bool = False, plan: Plan | None = None):
    """``run_many`` as a generator: each result as soon as it and those before it are done (``parallel.iter_many``),
    requests admitted by memory as ``run_many`` admits them.

    >>> for out in pipemap.iter_many(pipe, ({"prompt": p} for p in prompts)):               # doctest: +SKIP
    ...     out.images[0].save(...)
    """
    from .dispatch import parallel  # here: a pipeline only loaded never runs requests together

    return parallel.iter_many(pipe, calls, workers, return_exceptions=return_exceptions,
                              memory=memory_for(pipe, plan))


# what each runtime of a split's ranks (``Plan.ranks``) is priced as (``cost.rank_launch_seconds``, ``sequence_cost``)
RANKS_PRICED = {"process": "worker processes: each rank launches its kernels in its own interpreter, at once; an "
                           "exchange is an NCCL collective",
                "ray": "Ray actors: each rank launches its kernels in its own process, at once; an exchange is an "
                       "NCCL collective",
                "thread": "threads of one process: the ranks' launches one after the other (one interpreter lock), "
                          "an exchange a barrier pair"}


@dataclass(frozen=True)
class Estimate:
    """Predicted seconds of one call of a plan and their parts: each component's compute, copies and the copies its
    compute hides (``components``, ``cost.Cost``), the call (``work``), the images it makes and what priced it
    (``priced_by``: a dry run's counts, recorded or cached ones, or the formula; ``speeds``: where the GPU's figures
    come from)."""

    seconds: float
    components: dict[str, Cost]
    work: Workload
    priced_by: str = "formula"
    images: int = 1
    speeds: str = ""  # where the GPU's figures come from (``Performance.origin``): a fit, a generation's default
    launch: str = ""  # the host's seconds a kernel launch and where they come from (``Performance.kernel_text``)
    ranks: str | None = None  # what the split's ranks were priced as (``Plan.ranks``): None without a split

    @property
    def per_image(self) -> float:
        return self.seconds / max(1, self.images)

    @property
    def compute(self) -> float:
        return sum(c.compute for c in self.components.values())

    @property
    def transfer(self) -> float:
        return sum(c.transfer for c in self.components.values())

    @property
    def hidden(self) -> float:
        return sum(c.hidden for c in self.components.values())

    def __str__(self) -> str:
        lines = [f"{self.seconds:.3g} s a call ({self.work.describe()}), {self.per_image:.3g} s an image; priced by "
                 f"{self.priced_by}" + (f"; GPU speeds: {self.speeds}" if self.speeds else ""),
                 f"{'component':<18}{'compute s':>11}{'copies s':>11}{'hidden s':>11}{'total s':>11}"]
        for c in self.components.values():
            lines.append(f"{c.component:<18}{c.compute:>11.3g}{c.transfer:>11.3g}{c.hidden:>11.3g}{c.total:>11.3g}")
        if self.ranks is not None:
            lines.append(f"ranks: priced as {RANKS_PRICED[self.ranks]}")
        bound = launch_bound(self.components)
        if bound:
            launch = f"{self.launch}; " if self.launch else ""
            lines.append(f"launch-bound: {', '.join(bound)} wait for the host's kernel launches ({launch}a faster "
                         "host, CUDA graphs or torch.compile would speed them up, a faster GPU would not)")
        return "\n".join(lines)


def estimate(source, plan: Plan, *, hardware: Hardware | str | None = None, count: bool = True,
             **call) -> Estimate:
    """Predicted seconds of one call of ``source`` placed by ``plan`` on ``hardware`` (its GPUs' speeds and links;
    by default the machine the plan was made for, ``plan.performance``, else this machine), for the call ``call``
    describes (``num_inference_steps``, ``height``, ``width``, ``num_frames``, ``num_images_per_prompt``,
    ``guidance_scale``, ``negative_prompt``...), by the cost model ``auto`` uses.

    The work is what the pipeline does for that call, counted by a dry run at its shapes (guidance as the
    pipeline decides it: a pipeline whose true CFG needs a negative prompt makes one call a step without one); the
    count is kept by call shape, so the next estimate of the same shape, and ``auto``, need no dry run. A catalog
    name's default call is recorded. ``count=False`` (or an ``Inventory`` source) prices by the formula instead.

    >>> plan = pipemap.plan("flux.1-dev", hardware="2x16GiB", strategy="auto")                # doctest: +SKIP
    >>> pipemap.estimate("flux.1-dev", plan, hardware="2x16GiB,gpu=4090", num_inference_steps=28)  # doctest: +SKIP
    """
    if not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns")
    from .dryrun.counted import counts_for

    request = Request.of(source, hardware, dtype=plan.dtype, variant=plan.variant)
    inventory = request.inventory()
    work = workload_for(inventory, call)
    counts = counts_for(source, plan.dtype, call) if count else None
    if counts is not None:
        work = replace(work, steps=counts.steps)
    perf = plan.performance if hardware is None and plan.performance is not None else request.machine().performance
    parts = predict(plan, inventory, perf, work, counts=counts)
    priced = f"{counts.origin} counts" if counts is not None else "the formula on parameter counts"
    return Estimate(sum(c.total for c in parts.values()), parts, work, priced,
                    int(call.get("num_images_per_prompt") or 1), perf.origin, perf.kernel_text, plan.ranks)


def runnable(plan: Plan) -> Plan:
    """``plan`` with the GPUs this machine lacks remapped onto the CPU, every mode kept: the one rule of ``load``,
    ``run``, ``demo`` and ``serve`` (a plan made for another machine runs here, slowly, and they say so). A stand-in
    ``meta:N`` is left as it is, for ``load`` to refuse."""
    local = set(gpu_names())  # the GPUs alone: ``Hardware.detect`` also reads RAM and the doctor's figures
    missing = {d.device: "cpu" for d in plan.devices if d.device.startswith("cuda:") and d.device not in local}
    return plan.remap(missing) if missing else plan


def _lacking(plan: Plan, running: Plan) -> list[str]:
    here = {d.device for d in running.devices}
    return [d.device for d in plan.devices if d.device not in here]


def measured_plan(source, inventory: Inventory, hw: Hardware, strategy: str | dict, call: Mapping,
                  rounds: int = 4) -> Plan:
    """The plan whose headroom on each device covers the activation peak a dry run of ``call`` measures there.

    Placement changes what runs where, so it re-plans with the measured figures until a plan's own dry run fits
    its reservations; each device keeps the largest figure seen, so two layouts cannot take turns for ever.
    """
    if isinstance(source, Inventory):
        raise HeadroomError("measure", "a dry run needs a pipeline folder or a loaded pipeline, not an Inventory")
    from .dryrun.run import simulate as dry_run

    current = plan_inventory(inventory, hw, strategy, budgets(hw))
    reserve: dict[str, int] = {}
    for _ in range(rounds):
        report = dry_run(source, current, advice=False, **call)  # the peaks only: no tiling advice
        if not report.ok:
            raise SimulationFailedError(report)
        if reserve and all(v <= reserve.get(d, 0) for d, v in report.activation_bytes.items()):
            break
        reserve = {d: max(reserve.get(d, 0), report.activation_bytes.get(d, 0)) for d in hw.names}
        current = plan_inventory(inventory, hw, strategy, budgets(hw, reserve))
    note = "headroom measured by a dry run: " + ", ".join(f"{d} {format_bytes(b)}" for d, b in reserve.items())
    return replace(current, notes=current.notes + (note,))


def resolve_strategy(strategy: str | Mapping | None, device_map: str | Mapping | None) -> str | dict:
    """The one strategy asked for (``strategy`` or diffusers' ``device_map``), checked."""
    if strategy is not None and device_map is not None and strategy != device_map:
        raise ArgumentConflictError("strategy", strategy, "device_map", device_map)
    chosen = strategy if strategy is not None else device_map if device_map is not None else "balanced"
    if isinstance(chosen, Mapping):
        return _checked_map(chosen)
    name = chosen.strip().lower() if isinstance(chosen, str) else chosen  # "Balanced" is balanced
    if not isinstance(name, str) or (name not in STRATEGIES and name not in MIXED and name != AUTO):
        raise UnknownStrategyError(chosen, (AUTO, *STRATEGIES, *MIXED))
    return name


def _checked_map(mapping: Mapping) -> dict:
    for component, device in mapping.items():
        if not isinstance(component, str):
            raise ArgumentTypeError("strategy", dict(mapping), "a dict {component name: device}, names as strings")
        real_device(device)  # a bad device answers here, before any header is read
    return dict(mapping)


def _with_kept(hw: Hardware) -> Hardware:
    """This machine as detected, with what placed pipelines keep onloaded between calls counted as free: it is room
    their caches give up when short, not used memory (counted as used, a pipeline planned after another's call would
    get a room smaller by the other's kept VAE, and the shared room, the smallest, would shrink for both). Nothing
    moves to plan: ``dispatch`` gives it back before it places weights (issue 39)."""
    kept = kept_bytes()
    if not kept:
        return hw
    return replace(hw, devices=tuple(replace(d, memory=d.memory + kept.get(d.name, 0)) for d in hw.devices))


def _hardware(hardware: Hardware | str | None, max_memory: Mapping | None) -> Hardware | None:
    """A ``Hardware``, a spec string parsed, or None (this machine, detected when first needed)."""
    if hardware is not None and not isinstance(hardware, (Hardware, str)):
        raise ArgumentTypeError("hardware", hardware, "a spec string such as '2x24GiB,cpu=64GiB', a Hardware or None")
    if max_memory is not None and not isinstance(max_memory, Mapping):
        raise ArgumentTypeError("max_memory", max_memory, "a dict such as {0: '20GiB', 'cpu': '64GiB'} or None")
    hw = Hardware.parse(hardware) if isinstance(hardware, str) else hardware
    if hw is not None and max_memory:
        hw.with_max_memory(max_memory)  # its sizes and devices checked now; on this machine's, when detected
    return hw


def check_plan_arguments(plan: Plan, request: Request) -> None:
    """Arguments given beside a plan must say what the plan says (they were for making it): else an
    ``ArgumentConflictError``, before anything loads."""
    said, strategy = plan.device_map, request.strategy
    if isinstance(strategy, dict) and any(said.get(c) != real_device(d) for c, d in strategy.items()):
        raise _conflict("strategy", strategy, said)
    if isinstance(strategy, str) and strategy != plan.strategy:
        raise _conflict("strategy", strategy, f"a plan of strategy {plan.strategy!r}")
    memory = {d.device: d.memory for d in plan.devices}
    gpus = {d: m for d, m in memory.items() if d != "cpu"}  # a spec without cpu= takes the RAM free now: not compared
    if request.hardware is not None and {d.name: d.memory for d in request.hardware.gpus} != gpus:
        raise _conflict("hardware", str(request.hardware), f"a plan for {_machine(plan)}")
    max_memory = request.max_memory
    if max_memory is not None and any(memory.get(real_device(k)) != parse_bytes(v) for k, v in max_memory.items()):
        raise _conflict("max_memory", max_memory, f"a plan for {_machine(plan)}")
    if request.dtype is not None and str(request.dtype).removeprefix("torch.") != plan.dtype:
        raise _conflict("dtype", request.dtype, f"a plan for dtype {plan.dtype}")
    if request.variant is not None and request.variant != plan.variant:
        raise _conflict("variant", request.variant, f"a plan for variant {plan.variant}")
    if request.headroom is not None:
        raise _conflict("headroom", request.headroom, "a plan whose budgets are set already")


def _conflict(name: str, value, says) -> ArgumentConflictError:
    return ArgumentConflictError(name, value, "plan", says, "the plan already settles it: drop the argument, or "
                                 "make a new plan with it (pipemap.plan)")


def _machine(plan: Plan) -> str:
    return ",".join(f"{d.device}={d.memory}" for d in plan.devices)
