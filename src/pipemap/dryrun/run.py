"""The dry run's entry: a pipeline's real ``__call__`` on stand-in devices, to prove a plan and measure each device's
peak.

Every weight becomes a fake tensor (shape and dtype, no memory) on a stand-in device: ``cuda:N`` -> ``meta:N``
under ``FakeTensorMode``, where a tensor on ``meta:0`` meeting one on ``meta:1`` raises as two GPUs would. The plan is
applied by the same ``dispatch`` a real run uses, then the pipeline's own call runs, few steps, decoded to tensors.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect as pyinspect
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import cast

import accelerate
import torch
from PIL import Image
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm import tqdm

from .. import catalog
from ..counts import Counts, shape_of
from ..dispatch import place, planned
from ..errors import CallArgumentError, PipelineMappedError, PipemapError, SimulationFailedError
from ..hooks import unhook_component
from ..modes import Mode
from ..plan import Plan
from ..quiet import PATCHING, quiet_diffusers, quiet_transformers
from ..units import format_bytes
from . import catalog as catalog_dryrun
from . import known, patches, standin
from .counter import WorkCounter
from .queues import StandinQueues
from .report import Failure, SimulationReport, report_of
from .trackers import ComponentTracker, PhasedTracker, PhaseTracker


def _one_at_a_time(function):
    """``function`` run holding ``quiet.PATCHING``: a dry run patches library code process-wide (stand-in models
    built under accelerate's ``init_empty_weights``, ``patches``), so dry runs take turns with loads and each other."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with PATCHING, _hushed():
            return function(*args, **kwargs)

    return run


@contextlib.contextmanager
def _hushed() -> Iterator[None]:
    """What diffusers and transformers say at every dry run about the stand-ins (a fake VAE cast with ``to()``: "should
    be kept in float32: []", a fake tensor's ``__array__``) and about pipeline code that runs as written
    (``upcast_vae`` deprecated): said up to 4 times a dry run, and nothing the user can act on there."""
    with quiet_diffusers(), quiet_transformers(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
        warnings.filterwarnings("ignore", message="__array__ implementation", category=DeprecationWarning)
        yield


@_one_at_a_time
def simulate(source, plan: Plan, *, steps: int = 2, vae_tiling: bool = False, advice: bool = True,
             **call_kwargs) -> SimulationReport:
    """The dry run behind ``pipemap.simulate`` (``api.simulate``, which checks its arguments and documents them):
    ``source``'s own call on stand-in devices as ``plan`` places it; the caller's pipeline is never touched."""
    label = "pipemap: dry run" + (" (VAE tiled)" if vae_tiling else "")
    report, _, pipe = traced(source, plan, steps=steps, vae_tiling=vae_tiling, call=call_kwargs, progress=label)
    if advice and not vae_tiling and _tiles(getattr(pipe, "vae", None)):
        report = replace(report, advice=_tiling_advice(source, plan, steps, call_kwargs, report))
    return report


@_one_at_a_time
def traced(source, plan: Plan, *, steps: int = 2, vae_tiling: bool = False, call: Mapping | None = None,
           tracker: type[PhasedTracker] = PhasedTracker,
           progress: str | None = None) -> tuple[SimulationReport, PhasedTracker | None, object]:
    """``simulate``'s run without its tiling advice, with the tracker that counted it (of class ``tracker``; its
    figures keyed by stand-in devices, ``standin.devices_for(plan)``) and the fake pipeline it ran: ``dryrun.many``
    reads a call's course in the tracker. ``progress``: the label of a progress bar on stderr, shown on a terminal
    when the run lasts more than a few seconds."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    standins = standin.devices_for(plan)
    start = time.perf_counter()
    try:
        pipe = _fake_pipeline(source, plan, mode, standins)
    except standin.StandInError as err:  # a class the dry run cannot build: the report names it
        return _unbuilt(err, plan, time.perf_counter() - start), None, None
    if vae_tiling:
        pipe.vae.enable_tiling()
    made = dry_call(pipe, steps, call or {})
    start = time.perf_counter()
    counted, failure = _run(pipe, plan.remap(standins), mode, made, tracker, progress=progress)
    back = {v: k for k, v in standins.items()}
    return report_of(counted, failure, plan, back, time.perf_counter() - start, made), counted, pipe


@_one_at_a_time
def count_work(source, plan: Plan, *, steps: int = 2, **call_kwargs) -> Counts:
    """The FLOPs, bytes and kernels of ``source``'s call as ``plan`` places it, per component, counted by a dry run
    of ``steps`` denoising steps (``dryrun.counter``), for a call of the steps ``num_inference_steps`` asks (the
    pipeline's default when not given). A failed dry run raises ``SimulationFailedError``.

    >>> counts = count_work("flux.1-dev", plan, height=768, width=768)             # doctest: +SKIP
    >>> counts["transformer"].per_step.flops                                      # doctest: +SKIP
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    standins = standin.devices_for(plan)
    pipe = _fake_pipeline(source, plan, mode, standins)
    call = dry_call(pipe, steps, {k: v for k, v in call_kwargs.items() if k != "num_inference_steps"})
    counter = WorkCounter(pipe)
    start = time.perf_counter()
    tracker, failure = _run(pipe, plan.remap(standins), mode, call, counter=counter)
    if failure is not None:
        back = {v: k for k, v in standins.items()}
        raise SimulationFailedError(report_of(tracker, failure, plan, back, time.perf_counter() - start, call))
    return counter.counts(type(pipe).__name__, shape_of(call_kwargs), steps, call_steps(pipe, call_kwargs),
                          plan.dtype)


def call_steps(pipe, call_kwargs: Mapping) -> int:
    """The denoising steps a call runs: ``num_inference_steps`` if given, else the pipeline's own default."""
    if call_kwargs.get("num_inference_steps") is not None:
        return int(call_kwargs["num_inference_steps"])
    default = pyinspect.signature(type(pipe).__call__).parameters.get("num_inference_steps")
    return int(default.default) if default is not None and isinstance(default.default, int) else 50


def _tiles(vae) -> bool:
    """Whether ``vae.enable_tiling()`` works: diffusers' ``ModelMixin`` has the method on every model, and it raises
    on a VAE without tiling (Stable Video Diffusion's temporal decoder)."""
    return callable(getattr(vae, "enable_tiling", None)) and hasattr(vae, "use_tiling")


def _unbuilt(err: standin.StandInError, plan: Plan, seconds: float) -> SimulationReport:
    failure = Failure("stand-in build", err.component, (), str(err))
    zero = {d.device: 0 for d in plan.devices if d.used or d.device in plan.device_map.values()}
    return SimulationReport(False, failure, dict(zero), dict(zero), dict(zero), plan, seconds)


def _tiling_advice(source, plan: Plan, steps: int, call_kwargs: Mapping, report: SimulationReport) -> tuple:
    """When VAE decode sets a peak above its device's memory, whether ``vae.enable_tiling()`` brings it under."""
    memory = {d.device: d.memory for d in plan.devices}
    over = [d for d, peak in report.peak_bytes.items()
            if peak > memory.get(d, peak) and report.peak_phase.get(d, "").startswith("VAE decode")]
    if not over:
        return ()
    tiled = simulate(source, plan, steps=steps, vae_tiling=True, **call_kwargs)
    advice = []
    for device in over:
        after = tiled.peak_bytes.get(device, 0)
        verdict = "fits" if tiled.ok and after <= memory[device] else "still does not fit"
        advice.append(f"{device}: VAE decode peaks at {format_bytes(report.peak_bytes[device])}, above its "
                      f"{format_bytes(memory[device])}; with pipe.vae.enable_tiling() the peak is "
                      f"{format_bytes(after)}: {verdict}")
    return tuple(advice)


def _fake_pipeline(source, plan: Plan, mode: FakeTensorMode, standins: Mapping[str, str]):
    device_of = {p.component: standins[p.device] for p in plan.components}
    if isinstance(source, str) and not Path(source).exists() and (name := catalog.resolve(source)) is not None:
        return catalog_dryrun.pipeline(name, plan, mode, device_of)
    if isinstance(source, (str, os.PathLike)):
        pipe = standin.pipeline_from_folder(source, plan, mode, device_of)
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()  # as from_pretrained leaves a model: no training branch (dropout, HiDream's MoE)
        return pipe
    return _fake_copy(source, mode, device_of)


def _fake_copy(pipe, mode: FakeTensorMode, device_of: Mapping[str, str]):
    """A new pipeline object of the same class whose models are fake copies of ``pipe``'s; ``pipe`` is untouched."""
    mapped = planned(pipe)
    if mapped is not None and any(p.mode != Mode.RESIDENT for p in mapped.components):
        # offload and stream hooks hold the CPU masters of their weights, which a fake copy cannot share
        raise PipelineMappedError("pipemap.simulate on a pipeline with offloaded or streamed components")
    parts = {}
    for name, value in pipe.components.items():
        if isinstance(value, torch.nn.Module):
            try:
                module = standin.fake_module(value, mode, device_of.get(name, "cpu"))
            except Exception as err:  # a module deepcopy cannot copy: the report names it
                raise standin.StandInError(name, type(value).__name__, err) from err
            unhook_component(module)
            parts[name] = module
        else:
            parts[name] = copy.deepcopy(value) if "scheduler" in name else value
    names = _init_names(pipe)
    # registered options beside the components (SDXL img2img's requires_aesthetics_score, force_zeros_for_empty_prompt)
    options = {k: v for k, v in pipe.config.items() if k in names and k not in pipe.components}
    try:
        fake = type(pipe)(**options, **{k: v for k, v in parts.items() if k in names})
    except Exception as err:
        raise standin.StandInError(None, type(pipe).__name__, err) from err
    fake.set_progress_bar_config(disable=True)
    return fake


def _init_names(pipe) -> set[str]:
    return set(pyinspect.signature(type(pipe).__init__).parameters) - {"self"}


# pipelines that cannot run without an image to edit (its size sets the output's): a dry run gives them a blank one
EDITS = frozenset({"QwenImageEditPipeline", "QwenImageEditPlusPipeline"})


def dry_call(pipe, steps: int, overrides: Mapping) -> dict:
    """The pipeline's default call, few steps, decoded to tensors; a ControlNet pipeline gets a blank control image,
    an editing pipeline a blank image to edit."""
    call = {"prompt": "a dry run", "num_inference_steps": steps, "output_type": "pt",
            "generator": torch.Generator("cpu").manual_seed(0)}
    parameters = pyinspect.signature(type(pipe).__call__).parameters
    if "image" in parameters and "image" not in overrides:
        size = _resolution(pipe, overrides)
        if "controlnet" in pipe.components:
            call["image"] = torch.zeros(1, 3, size[0], size[1])
        elif type(pipe).__name__ in EDITS:  # they read the image's PIL size
            call["image"] = Image.new("RGB", (size[1], size[0]))
    unknown = tuple(k for k in overrides if k not in parameters)  # a pipeline's **kwargs only catch deprecated names
    if unknown:
        raise CallArgumentError(type(pipe).__name__, unknown, tuple(p for p in parameters if p != "self"))
    call.update(overrides)
    return {k: v for k, v in call.items() if k in parameters or _takes_kwargs(parameters)}


def _takes_kwargs(parameters) -> bool:
    return any(p.kind is pyinspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _resolution(pipe, overrides: Mapping) -> tuple[int, int]:
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    base = getattr(getattr(denoiser, "config", None), "sample_size", 64) * getattr(pipe, "vae_scale_factor", 8)
    return overrides.get("height", base), overrides.get("width", base)


def _run(pipe, plan: Plan, mode: FakeTensorMode, call: dict, tracker_class: type[PhasedTracker] = PhasedTracker,
         counter=None, progress: str | None = None):
    phases = PhaseTracker(pipe)
    components = ComponentTracker(pipe)
    tracker = tracker_class(phases, lambda: components.current)
    failure = None
    try:
        place(pipe, plan, queues=functools.partial(StandinQueues, tracker=tracker))
        tracker.track_module_tensors(pipe)
        vae = getattr(pipe, "vae", None)
        with _progress(progress, phases, call_steps(pipe, call)), phases.watching(pipe.scheduler), \
                standin.fused_attention(), standin.attention_kernels(), standin.standin_generators(), \
                patches.module_conversions(tracker), patches.tensor_outputs(), patches.host_copies(), \
                patches.staged_copies(), patches.safety_checks(pipe), patches.repeated_tiles(vae, tracker), \
                components, mode, \
                standin.StrictDevices(), tracker, counter or contextlib.nullcontext(), \
                known.known_values(tracker.assume):  # innermost: the trackers see what it rewrites
            pipe(**call)
    except Exception as err:  # a dry run reports what broke instead of raising it
        failure = _failure(err, components.current)
    return tracker, failure


@contextlib.contextmanager
def _progress(label: str | None, phases: PhaseTracker, steps: int):
    """A progress bar on stderr, from the phases the call goes through: shown only on a terminal, and only once the
    run has lasted a few seconds (a catalog pipeline at full size, a tiled decode), so a quick one prints nothing."""
    if label is None:
        yield
        return

    bar = tqdm(total=steps, desc=label, unit="step", delay=3, leave=False, file=sys.stderr, disable=None)

    def changed(phase) -> None:
        bar.n = min(phases.steps_done, steps)
        bar.set_postfix_str(str(phase), refresh=False)
        bar.update(0)  # drawn if the delay has passed, at most every tenth of a second

    phases.on_change = changed
    try:
        yield
    finally:
        phases.on_change = None
        bar.close()


_DEVICES = re.compile(r"\b((?:meta|cuda|cpu)(?::\d+)?)\b")


def _failure(err: Exception, component: str | None) -> Failure:
    where = _where(err)
    if isinstance(err, PipemapError) and not isinstance(err, standin.DeviceMixError):
        return Failure("dispatch", getattr(err, "component", None), (), str(err), where)
    if isinstance(err, standin.DeviceMixError):
        return Failure(err.operation, component, err.devices, str(err), where)
    devices = tuple(dict.fromkeys(_DEVICES.findall(str(err))))
    operation = getattr(err, "func", None) or type(err).__name__
    message = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
    return Failure(str(operation), component, devices, message, where)


def _where(err: Exception) -> str:
    """The two innermost frames of diffusers', transformers' or the user's code that the error passed through."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not _library_frame(f.filename)]
    return " -> ".join(f"{Path(f.filename).name}:{f.lineno} ({f.name}: {(f.line or '').strip()[:100]})"
                       for f in frames[-2:])


_SKIPPED = tuple(str(Path(cast(str, m.__file__)).resolve().parent) + os.sep for m in (torch, accelerate))
_OWN = str(Path(__file__).resolve().parent.parent) + os.sep  # pipemap's own folder, not any folder named pipemap


def _library_frame(filename: str) -> bool:
    path = str(Path(filename).resolve())
    return path.startswith(_OWN) or path.startswith(_SKIPPED)


