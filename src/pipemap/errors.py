"""Every error pipemap raises, and every warning it gives. Each error carries its data as attributes and its message
says what to do. The few signals raised and caught inside pipemap (never seen by a user) are here too, at the end:
no exception class is defined anywhere else (``tests/test_errors.py``).

Errors in what the user gave (a map, a memory string, a folder) also derive from ``ValueError``, so code that
already catches diffusers' ``ValueError`` for a bad ``device_map`` keeps working.
"""

from __future__ import annotations

import difflib
from typing import Protocol


class _Failed(Protocol):
    """What ``SimulationFailedError`` reads of a ``dryrun.report.SimulationReport``."""

    @property
    def error(self) -> object: ...


class PipemapError(Exception):
    """The base of every pipemap error."""


class MemorySpecError(PipemapError, ValueError):
    """A memory size that is not an integer or a string like ``"24GiB"``."""

    def __init__(self, text: object):
        self.text = text
        super().__init__(
            f"cannot read {text!r} as a memory size: write an integer number of bytes or a string such as "
            "'512MB', '24GiB' or '1.5TB' (KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024)"
        )


class HardwareSpecError(PipemapError, ValueError):
    """A hardware profile string that cannot be read."""

    def __init__(self, spec: str, part: str, reason: str):
        self.spec, self.part, self.reason = spec, part, reason
        super().__init__(
            f"cannot read {part!r} in the hardware spec {spec!r}: {reason}. Write devices as "
            "'cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB' or the shorthand '2x24GiB,cpu=64GiB'"
        )


class UnknownDeviceError(PipemapError, ValueError):
    """A device that this machine or the hardware profile lacks, or a name that is not a device pipemap runs on."""

    def __init__(self, device: object, available: tuple[str, ...], reason: str = ""):
        self.device, self.available, self.reason = device, tuple(available), reason
        what = reason or "is not on this machine or in the hardware profile"
        super().__init__(
            f"device {device!r} {what}; the devices are {', '.join(self.available) or 'none'}. Use one of them "
            "('cpu', 'cuda:N' or an index N), or describe the target machine with "
            "hardware='cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB'"
        )


class UnknownComponentError(PipemapError, ValueError):
    """A component named in a device map that the pipeline does not have."""

    def __init__(self, component: str, known: tuple[str, ...]):
        self.component, self.known = component, tuple(known)
        super().__init__(
            f"the pipeline has no component {component!r} with weights; its components are: "
            f"{', '.join(self.known)}. Fix the name in the device map"
        )


class UnknownStrategyError(PipemapError, ValueError):
    """A strategy name pipemap does not know."""

    def __init__(self, strategy: object, known: tuple[str, ...], reason: str = ""):
        self.strategy, self.known, self.reason = strategy, tuple(known), reason
        close = difflib.get_close_matches(str(strategy).strip().lower(), self.known, n=1, cutoff=0.6)
        self.suggestion = close[0] if close else None
        mean = f": did you mean {self.suggestion!r}?" if self.suggestion else "."
        super().__init__(
            f"unknown strategy {strategy!r}{f' ({reason})' if reason else ''}{mean} Use one of "
            f"{', '.join(self.known)}, or a dict {{component: device}}"
        )


class DoesNotFitError(PipemapError, ValueError):
    """A component that fits no device its strategy may use."""

    def __init__(self, component: str, bytes: int, largest_room: int, strategy: str, strategies: tuple[str, ...],
                 device: str | None = None):
        self.component, self.bytes, self.largest_room = component, bytes, largest_room
        self.strategy, self.strategies, self.device = strategy, tuple(strategies), device
        where = f"on {device}" if device else "on any GPU"
        fix = (f"strategies that would work: {', '.join(self.strategies)}" if self.strategies
               else "no strategy fits it on these devices")
        super().__init__(
            f"{component!r} needs {_fmt(bytes)} but the largest room left {where} is {_fmt(largest_room)} under "
            f"strategy {strategy!r}; {fix}; or give more memory (max_memory=), a smaller dtype, or map it to "
            "'cpu' in a dict device_map"
        )


class HostMemoryError(DoesNotFitError):
    """Host copies that must be in RAM (weights that cannot stay in their files) and do not fit the CPU's budget."""

    def __init__(self, component: str, bytes: int, budget: int, strategy: str):
        self.component, self.bytes, self.largest_room = component, bytes, budget
        self.strategy, self.strategies, self.device = strategy, (), "cpu"
        ValueError.__init__(
            self,
            f"under strategy {strategy!r} the CPU must hold {_fmt(bytes)} in RAM (the largest part {component!r}) "
            f"but its budget is {_fmt(budget)}: weights that cannot stay in their files (stored at another dtype "
            "than the one asked for, or built in memory) must be in RAM. Load at the dtype the files are stored in "
            "(they then stay memory-mapped on the disk), give the CPU more memory (cpu= in the hardware spec, "
            "max_memory={'cpu': ...}), or give the GPUs more"
        )


class NotAPipelineError(PipemapError, ValueError):
    """A path that is not a diffusers pipeline folder."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"{path!r} is not a diffusers pipeline folder: {reason}. Give a folder with model_index.json and "
            "one subfolder per component, as written by DiffusionPipeline.save_pretrained"
        )


class CheckpointError(PipemapError, ValueError):
    """A missing or corrupt safetensors file or header."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"cannot read the safetensors header of {path!r}: {reason}. Re-download or re-save the component"
        )


class ArgumentConflictError(PipemapError, ValueError):
    """Two arguments that say different things (``dtype`` and ``torch_dtype``, ``strategy`` and ``device_map``)."""

    def __init__(self, first: str, first_value: object, second: str, second_value: object,
                 fix: str = "they are two names for the same setting: pass only one"):
        self.first, self.first_value, self.second, self.second_value = first, first_value, second, second_value
        super().__init__(f"{first}={_short(first_value)} and {second}={_short(second_value)} disagree; {fix}")


class PipelineMappedError(PipemapError, RuntimeError):
    """An operation that a pipemap-mapped pipeline does not allow (``pipe.to``, diffusers' own offload)."""

    def __init__(self, operation: str):
        self.operation = operation
        super().__init__(
            f"{operation} is not allowed on a pipeline placed by pipemap: call pipemap.reset(pipe) first, "
            "which removes pipemap's hooks and brings every component back to the CPU"
        )


class DispatchError(PipemapError, RuntimeError):
    """Applying a plan failed; the pipeline was left exactly as it was."""

    def __init__(self, component: str, device: str, cause: BaseException):
        self.component, self.device, self.cause = component, device, cause
        super().__init__(
            f"placing {component!r} on {device} failed ({type(cause).__name__}: {cause}); the pipeline was "
            "restored as it was before dispatch. Check the device and its free memory, or re-plan"
        )


def format_bytes(n: int) -> str:
    """A short human figure in powers of 1024: ``format_bytes(3 * 2**30) == "3.00 GiB"``.

    It lives here, at the bottom of the package, because error messages need it; ``pipemap.units`` re-exports it.
    """
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


_fmt = format_bytes


class UnknownDtypeError(PipemapError, ValueError):
    """A dtype name torch does not know, or one weights cannot be loaded in (integer, bool, complex)."""

    def __init__(self, dtype: object, reason: str = "torch has no such dtype"):
        self.dtype, self.reason = dtype, reason
        super().__init__(f"dtype {dtype!r}: {reason}. Use a floating dtype such as torch.float16, or "
                         "'float16'/'bfloat16'/'float32'")


class PlanMismatchError(PipemapError, ValueError):
    """A plan that does not match the pipeline it is applied to."""

    def __init__(self, component: str, reason: str):
        self.component, self.reason = component, reason
        super().__init__(f"cannot dispatch {component!r}: {reason}")


class HeadroomError(PipemapError, ValueError):
    """A headroom that is not a fraction in [0, 1), a memory size, a per-device dict of those, or "measure"."""

    def __init__(self, headroom: object, reason: str):
        self.headroom, self.reason = headroom, reason
        super().__init__(
            f"headroom {headroom!r}: {reason}. Give a fraction of each GPU (0.1), bytes ('2GiB'), a dict per device "
            "({'cuda:0': '4GiB'}), or 'measure' to reserve what a dry run measures"
        )


class SimulationFailedError(PipemapError, RuntimeError):
    """A dry run that was needed (``headroom="measure"``) failed; ``report`` says where and why."""

    def __init__(self, report: _Failed):
        self.report = report
        super().__init__(f"the dry run failed: {report.error}. Fix the plan or the call (call={{...}}) and retry")


class ArgumentTypeError(PipemapError, ValueError, TypeError):
    """An argument of the wrong type (``hardware=5``, ``dispatch(pipe, "balanced")``)."""

    def __init__(self, argument: str, value: object, expected: str):
        self.argument, self.value, self.expected = argument, value, expected
        super().__init__(f"{argument}={_short(value)} is a {type(value).__name__}: give {expected}")


class PlanFormatError(PipemapError, ValueError):
    """A saved plan (``Plan.from_json``) that is not valid: bad JSON, a missing key, a wrong type, an unknown mode
    or device."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"cannot read the plan: {reason}. Save plans with plan.to_json() and load them with "
                         "Plan.from_json(), or make a new one with pipemap.plan()")


class VariantNotFoundError(PipemapError, ValueError):
    """A weights ``variant`` that no component of the pipeline folder has files for."""

    def __init__(self, path: str, variant: str, available: tuple[str, ...]):
        self.path, self.variant, self.available = path, variant, tuple(available)
        super().__init__(f"no component of {path!r} has weights of variant {variant!r}; the variants there are: "
                         f"{', '.join(self.available) or 'none (plain files only)'}. Pass one of them, or no variant")


class CallArgumentError(PipemapError, ValueError):
    """Keyword arguments for a pipeline call that the pipeline's ``__call__`` does not take."""

    def __init__(self, pipeline: str, names: tuple[str, ...], accepted: tuple[str, ...]):
        self.pipeline, self.names, self.accepted = pipeline, tuple(names), tuple(accepted)
        super().__init__(f"{pipeline}.__call__ takes no argument {', '.join(map(repr, self.names))}; it takes: "
                         f"{', '.join(self.accepted)}. Fix or drop the argument")


class FolderNotEmptyError(PipemapError, ValueError):
    """A folder to write into that already holds something: pipemap never overwrites a user's files."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(f"{path!r} exists and is not an empty folder; pipemap writes only into a new or empty one: "
                         "give another path")


class OutputPathError(PipemapError, ValueError):
    """A path to write a file at that cannot be one: a folder, or below a regular file."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"cannot write {path!r}: {reason}; give a file path in a folder")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- parallel.py: overlapped requests and denoiser replicas --------------------------------------------------------


class RunManyCallError(PipemapError, ValueError):
    """An argument of ``run_many`` it cannot use: ``workers`` below 1, a call that is not a keyword dict."""

    def __init__(self, argument: str, value: object, fix: str):
        self.argument, self.value, self.fix = argument, value, fix
        super().__init__(f"run_many: {argument} is {value!r}: {fix}")


class ForeignHookError(PipemapError, RuntimeError):
    """A component carries a hook pipemap did not put there (``enable_model_cpu_offload``, a device_map)."""

    def __init__(self, component: str, hook: str):
        self.component, self.hook = component, hook
        super().__init__(
            f"{component!r} carries the hook {hook}, which moves weights without a lock, so requests run at once "
            "would evict each other's weights: call pipe.remove_all_hooks() and place the pipeline with "
            "pipemap.dispatch(pipe, pipemap.plan(pipe, ...)) instead"
        )


# ---- admission.py: requests admitted by the memory their activations need ----------------------------------------


class CallTooLargeError(PipemapError, ValueError):
    """A call whose activations, measured by a dry run at its own shape, do not fit beside the plan's weights on
    some device even when it runs alone: ``needs`` bytes there against ``room`` (``memory`` less the weights)."""

    def __init__(self, device: str, needs: int, room: int, memory: int, phase: str = "", advice: tuple[str, ...] = ()):
        self.device, self.needs, self.room, self.memory = device, needs, room, memory
        self.phase, self.advice = phase, tuple(advice)
        by = f" (its peak set by {phase})" if phase else ""
        fix = "; ".join(self.advice) or "plan for more memory, or a strategy that leaves more room on it"
        super().__init__(
            f"the call needs {_fmt(needs)} of activations on {device}{by}, but the plan leaves {_fmt(room)} there "
            f"beside its weights ({_fmt(memory)} of memory, {_fmt(memory - room)} of weights): {fix}"
        )
# ---- a placed pipeline whose models change -----------------------------------------------------------------------


class ComponentChangedError(PipemapError, ValueError):
    """A change to a placed pipeline's model that pipemap cannot follow where it is: ``fix`` is the call to make."""

    def __init__(self, component: str, reason: str, fix: str):
        self.component, self.reason, self.fix = component, reason, fix
        super().__init__(f"cannot keep {component!r} placed: {reason}; call {fix}")


# ---- the disk tier: weights read from their files at each call ----------------------------------------------------


class WeightsFileChangedError(CheckpointError):
    """A safetensors file a component is read from at each call (the disk tier) changed in place since it was
    mapped: its new bytes are not the model that was loaded (and past a truncated end, a read would kill the
    process)."""

    def __init__(self, path: str, component: str, change: str):
        self.path, self.component, self.reason = path, component, change
        PipemapError.__init__(
            self, f"{path!r}, which {component or 'a component'!r} is read from at each call, changed since it was "
            f"loaded ({change}): put the file back, or load the pipeline again (pipemap.reset(pipe), then load and "
            "dispatch); to save new weights, write them to a new file and rename it over the old one")


# ---- hooks/workers.py: a process per device for a split denoiser -------------------------------------------------


class WorkersOptionError(PipemapError, ValueError):
    """An environment setting of the worker processes that cannot be read."""

    def __init__(self, variable: str, value: object, accepted: tuple[str, ...], why: str = "is not understood"):
        self.variable, self.value, self.accepted, self.why = variable, value, tuple(accepted), why
        super().__init__(f"{variable}={value!r} {why}: set it to one of {', '.join(self.accepted)}")


class WorkerDiedError(PipemapError, RuntimeError):
    """A worker process of a split denoiser died (``exitcode``: its exit code, where known), or gave no answer within
    ``timeout_s`` (None where it died), during ``phase`` (start, sync, call). Its component's workers are stopped;
    the next call starts new ones."""

    def __init__(self, component: str, device: str, pid: int, phase: str, exitcode: int | None,
                 timeout_s: float | None):
        self.component, self.device, self.pid, self.phase = component, device, pid, phase
        self.exitcode, self.timeout_s = exitcode, timeout_s
        why = f"gave no answer within {timeout_s:g} s" if timeout_s is not None else (
            f"exited with code {exitcode}" if exitcode is not None else "closed its connection")
        super().__init__(
            f"the worker process (pid {pid}) running {component!r} on {device} {why} during its {phase}: its "
            "workers were stopped and the next call starts new ones; if this repeats, look at the worker's device "
            "(memory, driver), raise PIPEMAP_WORKER_TIMEOUT for slow calls, or set PIPEMAP_WORKERS=thread"
        )


class RanksSelfTestError(PipemapError, RuntimeError):
    """The bring-up check of a split's process group failed: a collective over a known tensor gave a wrong result
    (``why``), on the ranks of ``devices``. ``ranks="auto"`` then runs the split's ranks as threads, and says so."""

    def __init__(self, component: str, devices: list[str], why: str):
        self.component, self.devices, self.why = component, list(devices), why
        super().__init__(
            f"the worker processes of {component!r} on {', '.join(self.devices)} failed their bring-up check ({why}): "
            "their links corrupt or lose data; plan with ranks='thread', or check the GPUs with `pipemap doctor`"
        )


class CannotTravelError(PipemapError, ValueError):
    """A component whose split ranks were asked to run as worker processes (``ranks="process"`` or ``"ray"``) that
    cannot be sent to one (``why``: the object that cannot be pickled, or a class of the script's ``__main__``);
    said at dispatch, before any worker starts."""

    def __init__(self, component: str, why: str):
        self.component, self.why = component, why
        super().__init__(
            f"{component!r} cannot be sent to a worker process: {why}. Run its ranks as threads (ranks='thread'), "
            "or let pipemap choose (ranks='auto': threads where the model cannot travel)"
        )


class RayPlacementError(PipemapError, RuntimeError):
    """``PIPEMAP_WORKERS=ray``: Ray could not place the workers' bundles (``bundles``, one per worker) on one node
    (``STRICT_PACK``) within ``timeout_s``; ``available``: what the cluster had free then."""

    def __init__(self, component: str, bundles: list[dict[str, float]], available: dict[str, float],
                 timeout_s: float):
        self.component, self.bundles, self.available, self.timeout_s = component, list(bundles), available, timeout_s
        super().__init__(
            f"Ray could not place the workers of {component!r} ({len(self.bundles)} bundles {self.bundles}, all on one "
            f"node) within {timeout_s:g} s; the cluster has {available} free: free those resources, add a node with "
            "them, or set PIPEMAP_WORKERS=process to start the workers on this machine without Ray"
        )


class WorkerCallError(PipemapError, RuntimeError):
    """An exception inside a worker process of a split denoiser; ``remote_traceback`` is the worker's traceback."""

    def __init__(self, component: str, device: str, pid: int, phase: str, remote_traceback: str):
        self.component, self.device, self.pid, self.phase = component, device, pid, phase
        self.remote_traceback = remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "no traceback"
        super().__init__(
            f"the worker process (pid {pid}) running {component!r} on {device} failed during its {phase}: {last}. "
            f"Its workers were stopped; fix the cause shown in .remote_traceback, or set PIPEMAP_WORKERS=thread"
        )


# ---- runtime/streams.py: the copy queues' race checks --------------------------------------------------------------


class UnwaitedCopyError(PipemapError, RuntimeError):
    """A block's weights were used on the compute queue before it waited for their copy: on a GPU, garbage."""

    def __init__(self, block: str, device: str):
        self.block, self.device = block, device
        super().__init__(f"block {block!r} used on {device} before the compute queue waited for its copy; every "
                         "onloaded block must be waited for (Queues.wait) before it runs")


class BufferReuseError(PipemapError, RuntimeError):
    """A copy was queued into a buffer the compute queue may still be reading."""

    def __init__(self, block: str, device: str):
        self.block, self.device = block, device
        super().__init__(f"copy of block {block!r} on {device} queued into a buffer before the end of its last use; "
                         "pass the buffer's last-use event as `after`")


# ---- warnings (runtime/transfer.py: copies between devices) --------------------------------------------------------


class PipemapWarning(UserWarning):
    """The base of every warning pipemap gives."""


class DecimalSizeWarning(PipemapWarning):
    """A memory size in a hardware spec or ``max_memory`` written in KB/MB/GB/TB, read as powers of 1000 (``16GB`` is
    14.90 GiB): the message says how it was read and the binary spelling (``16GiB``)."""


class UnsafeTransferWarning(PipemapWarning):
    """Direct copies between two devices arrive corrupted; pipemap stages them through CPU memory."""


class RanksFallbackWarning(PipemapWarning):
    """``ranks="auto"`` chose worker processes for a split, but ``component`` runs its ranks as threads instead
    (``why``: it cannot travel to a worker, or the group failed its bring-up check)."""

    def __init__(self, component: str, runtime: str, why: str):
        self.component, self.runtime, self.why = component, runtime, why
        super().__init__(f"pipemap: {component!r} runs its split ranks as threads, not as {runtime} workers: {why} "
                         "(ranks='thread' says so without this warning)")


# ---- dryrun/standin.py: stand-in devices and weights ---------------------------------------------------------------


class DeviceMixError(PipemapError, RuntimeError):
    """One operation got tensors on several devices, as a real multi-GPU run would fail."""

    def __init__(self, operation: str, devices: tuple[str, ...]):
        self.operation, self.devices = operation, devices
        super().__init__(f"{operation} got tensors on {', '.join(devices)}")


class StandInError(PipemapError, RuntimeError):
    """The dry run could not build a component (or the pipeline) of this class on stand-in weights; the report
    names it instead of raising."""

    def __init__(self, component: str | None, class_name: str, err: Exception):
        self.component, self.class_name = component, class_name
        what = f"component {component!r} ({class_name})" if component else f"the pipeline {class_name}"
        super().__init__(f"the dry run cannot build {what} on stand-in weights ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:300] if str(err) else ''}); load it for real (pipemap.load) "
                         "to check this plan")


# ---- dryrun/known.py: values the dry run cannot know ---------------------------------------------------------------


class UnknownValueError(PipemapError, RuntimeError):
    """Pipeline code read, as data, a value computed from weights: the dry run cannot know it."""

    def __init__(self, operation: str):
        self.operation = operation
        super().__init__(f"{operation} reads a value computed from weights, which a dry run cannot know; run the "
                         "pipeline for real (pipemap.load) to check this code path")


# ---- serve/requests.py: what a request may ask ---------------------------------------------------------------------


class RequestError(PipemapError, ValueError):
    """A request this server cannot take: ``param`` names the field, ``code`` is a short machine-readable kind."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value"):
        self.param, self.code, self.message = param, code, message
        super().__init__(message)


class ModelNotFoundError(RequestError):
    """A request naming a model this server does not serve (HTTP 404, as OpenAI answers): ``names`` are those it
    does."""

    def __init__(self, model: str, names: tuple[str, ...]):
        self.model, self.names = model, names
        super().__init__("model", f"the model {model!r} is not served here: this server serves "
                         f"{', '.join(map(repr, names))} (GET /v1/models lists them)", "model_not_found")


# ---- serve/worker.py: the queue in front of a pipeline -------------------------------------------------------------


class QueueFullError(PipemapError):
    """The queue holds ``max_queue`` waiting requests; ``retry_after`` is the seconds it should take to drain."""

    def __init__(self, depth: int, retry_after: int):
        self.depth, self.retry_after = depth, retry_after
        super().__init__(f"the queue is full ({depth} requests waiting): retry in {retry_after} s")


class DrainingError(PipemapError):
    """The server is shutting down: it finishes the work it took and takes no more."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down and takes no new work: send the request to another one")


class WorkDropped(PipemapError):
    """Raised inside a pipeline call (at a step's end) whose request timed out, so its remaining steps are not run."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"the request timed out; its work was dropped after step {step}")


# ---- serve/deployment.py: Ray Serve replicas -----------------------------------------------------------------------


class AutoscaleSpecError(PipemapError, ValueError):
    """An ``--autoscale`` value that is not ``MIN:MAX``."""

    def __init__(self, text: str):
        self.text = text
        super().__init__(f"cannot read --autoscale {text!r}: write MIN:MAX replicas, e.g. '1:4' (0 <= MIN <= MAX, "
                         "MAX >= 1)")


# ---- signals: raised and caught inside pipemap, never seen by a user ------------------------------------------------


class Unsplittable(Exception):
    """Raised by every rank at the same layer: a tensor there does not divide among the ranks (hooks/sequence.py)."""


class BodyTooLarge(Exception):
    """A body that grew past the limit as it was read (no Content-Length, or a false one) (serve/app.py)."""


class DryRunDropped(BaseException):  # noqa: N818 - a signal, as asyncio's CancelledError, not an error
    """A dry run stopped at its next operation because no request waits for its figures any more (their clients
    left, their time ran out: ``runtime.admission.wanted_while``). A BaseException, as ``asyncio.CancelledError``:
    the pipeline code a dry run runs, and the dry run's own failure report, catch ``Exception``."""


class ClientGone(Exception):
    """The client closed its connection before its answer (serve/app.py)."""
