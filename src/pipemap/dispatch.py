"""Apply a plan to a pipeline in memory, and undo it.

One accelerate hook at the root of each component moves its inputs to the component's device and its outputs to
the pipeline's execution device, so the pipeline's own ``__call__`` runs unchanged. The hook follows the placement's
mode: ``PlacementHook`` for a resident component, ``offload.OffloadHook`` / ``offload.StreamHook`` for one that lives
in CPU RAM and runs on a GPU. ``dispatch`` is atomic: if
placing any component fails, every component is put back where it was and the error says which one failed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from diffusers.utils.accelerate_utils import apply_forward_hook

from .errors import ArgumentTypeError, DispatchError, PipelineMappedError, PlanMismatchError
from .hooks import CallLock, Moved, PlacementHook
from .plan import Plan
from .transfer import ensure_safe_transfers, move_tensor, plan_devices

__all__ = ["Moved", "PlacementHook", "SplitHook", "dispatch", "reset"]  # the hooks live in hooks.py, below offload

# diffusers' VAEs run `encode`/`decode` through `apply_forward_hook`, which calls `pre_forward(module)` with no
# arguments, so inputs would stay where they are; those methods get a wrapper of their own (found by this code).
_FORWARD_HOOK_CODE = apply_forward_hook(lambda self: None).__code__
_GUARDED = ("to", "enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload",
            "reset_device_map")


@dataclass(frozen=True)
class Move:
    """One tensor ``place_module`` moved: enough to put it back if the dispatch fails later."""

    owner: torch.nn.Module
    store: str  # "_parameters" or "_buffers"
    key: str
    original: torch.Tensor
    device: torch.device
    data: torch.Tensor | None = None  # a parameter's .data before the move, which the move replaces in place

    def undo(self) -> None:
        # the data it had, not a copy back: nothing to allocate (a failed dispatch may be out of memory), and
        # nothing lost when the move went where data cannot come back from
        if self.data is not None and self.original.data is not self.data:
            self.original.data = self.data
        getattr(self.owner, self.store)[self.key] = self.original


def dispatch(pipe, plan: Plan, *, check_transfers: bool = True) -> None:
    """Place and hook every component of ``pipe`` as ``plan`` says; the pipeline's own call then runs unchanged.

    When the plan spans two GPUs or more, copies between them are checked first (``pipemap.check_transfers``,
    cached) and a pair that corrupts data is staged through CPU memory; ``check_transfers=False`` skips that.

    >>> pipe = DiffusionPipeline.from_pretrained("path/to/sdxl")                  # doctest: +SKIP
    >>> plan = pipemap.plan(pipe, hardware="2x24GiB")                             # doctest: +SKIP
    >>> pipemap.dispatch(pipe, plan); pipe.hf_device_map                          # doctest: +SKIP
    {'text_encoder': 'cuda:1', 'text_encoder_2': 'cuda:1', 'unet': 'cuda:0', 'vae': 'cuda:1'}
    """
    modules = _check(pipe, plan)
    if check_transfers:  # runs (cached) only when the plan spans two GPUs or more; stages corrupted pairs
        ensure_safe_transfers(plan_devices(plan))  # every GPU it copies between: execution GPUs and shards too
    moves: list[Move] = []
    make_hook = _hook_maker(plan)
    for placement in plan.components:
        module = modules[placement.component]
        try:
            _place(module, placement, moves)  # records each tensor as it moves, so a failure part-way undoes it
            hook_component(module, make_hook(placement))
        except Exception as err:
            _undo(modules.values(), moves)
            raise DispatchError(placement.component, placement.device, err) from err
    _mark(pipe, plan)


def _hook_maker(plan: Plan):
    """``placement -> hook``; the offloading hooks of one dispatch share one ledger of what is onloaded where."""
    if all(p.mode in ("resident", "split", "replicated") for p in plan.components):
        return lambda p: _resident_hook(p, plan.execution_device)
    from . import offload  # here: a plan without offloading needs none of it

    ledger = offload.Ledger()
    moving = CallLock()  # the moving hooks share a ledger (and evict each other): one at a time

    def make(p):
        if p.mode in ("offload", "stream"):
            hook = offload.hook_for(p, plan.execution_device, ledger)
            hook.lock = moving
            return hook
        return _resident_hook(p, plan.execution_device)

    return make


def _resident_hook(p, execution_device: str) -> PlacementHook:
    if p.mode == "replicated":
        from .parallel import ReplicaHook  # it builds on this module

        return ReplicaHook(p.component, p.device, execution_device, p.replicas)
    if p.mode == "split":
        return SplitHook(p.component, p.device, execution_device, p.shards)
    return PlacementHook(p.component, p.device, execution_device)


def reset(pipe) -> None:
    """Remove every pipemap hook and bring every component back to the CPU, as before ``dispatch``.

    >>> pipemap.reset(pipe); pipe.hf_device_map is None                           # doctest: +SKIP
    True
    """
    check_pipeline(pipe, "reset")
    for module in _modules(pipe).values():
        unhook_component(module)
        place_module(module, "cpu")
    for name in _GUARDED:
        pipe.__dict__.pop(name, None)
    pipe.__dict__.pop("_pipemap_plan", None)
    pipe.__dict__.pop("hf_device_map", None)  # back to the class's None, as before dispatch
    from .parallel import unguard_calls

    unguard_calls(pipe)


def planned(pipe) -> Plan | None:
    """The plan a pipeline was dispatched with, or None."""
    return pipe.__dict__.get("_pipemap_plan")


def _place(module: torch.nn.Module, placement, moves: list[Move] | None = None) -> list[Move]:
    """A component's tensors onto its planned devices; a split component's blocks straight to theirs, so no GPU
    ever holds the whole of a component that was split because it fits none. Each move is appended to ``moves`` as
    it happens (see ``place_module``)."""
    moves = [] if moves is None else moves
    placed: set[int] = set()
    for path, device, _ in placement.shards:
        block = module.get_submodule(path)
        place_module(block, device, moves=moves)
        placed |= {id(m) for m in block.modules()}
    return place_module(module, placement.device, skip=placed, moves=moves)


def place_module(module: torch.nn.Module, device: str | torch.device, skip: set[int] = frozenset(),
                 moves: list[Move] | None = None) -> list[Move]:
    """Move every parameter and buffer not yet on ``device`` there, through the one transfer function; returns what
    it moved, so a failed dispatch can put exactly that back (a load places most tensors already where they go).
    Each move is appended to ``moves`` (when given) before the tensor is replaced, so a failure at any tensor leaves
    the caller a record of every tensor already moved.

    ``module.to`` would do for real tensors, but it reassigns every tensor even when already in place (which fake
    weights of a dry run refuse) and bypasses pipemap's safe-copy routing.
    """
    target = torch.device(device)
    moves = [] if moves is None else moves
    for sub in module.modules():
        if id(sub) in skip:
            continue
        for key, param in sub._parameters.items():
            if param is not None and param.device != target:
                moves.append(Move(sub, "_parameters", key, param, param.device, param.data))
                _move_parameter(sub, key, param, target)
        for key, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != target:
                moves.append(Move(sub, "_buffers", key, buffer, buffer.device))
                sub._buffers[key] = move_tensor(buffer, target)
    return moves


def _move_parameter(owner: torch.nn.Module, key: str, param: torch.nn.Parameter, target: torch.device) -> None:
    moved = move_tensor(param.data, target)
    try:
        param.data = moved  # keeps the Parameter object, so tied weights stay tied
    except RuntimeError:
        pass
    if param.device != target:  # fake tensors of a dry run refuse (or ignore) .data across devices
        owner._parameters[key] = torch.nn.Parameter(moved, requires_grad=param.requires_grad)


class SplitHook(PlacementHook):
    """A component cut across GPUs: its root on ``device``, each block of ``shards`` on its own GPU with a hook that
    brings the block's inputs there. A run of consecutive blocks of one list on one GPU passes activations on
    directly; only the last block of the run returns its outputs to ``device`` (the dry run proves a plan's
    component touches nothing of them between two blocks)."""

    def __init__(self, component: str, device: str, execution_device: str, shards: tuple[tuple[str, str, int], ...]):
        super().__init__(component, device, execution_device)
        self.shards = shards

    def init_hook(self, module):  # dispatch has placed the blocks already (``_place``)
        for (path, device, _), last in zip(self.shards, _run_ends(self.shards)):
            add_hook_to_module(module.get_submodule(path), PlacementHook(f"{self.component}.{path}", device,
                                                                         str(self.device) if last else device))
        return module

    def detach_hook(self, module):
        for path, _, _ in self.shards:
            unhook_component(module.get_submodule(path))
        return module


def _run_ends(shards: tuple[tuple[str, str, int], ...]) -> list[bool]:
    """For each shard, whether it ends a run: the next shard is not the next element of its list on its GPU."""
    ends = []
    for (path, device, _), following in zip(shards, [*shards[1:], None]):
        prefix, _, index = path.rpartition(".")
        ends.append(following is None or following[1] != device or not index.isdigit()
                    or following[0] != f"{prefix}.{int(index) + 1}")
    return ends


def hook_component(module: torch.nn.Module, hook: ModelHook) -> None:
    """Attach ``hook`` at the component's root, and to the methods diffusers routes through ``apply_forward_hook``.

    A call that raises skips accelerate's ``post_forward``: a forward hook that always runs then tells the hook
    (``abort``, where it has one), so an offloaded or streamed component leaves nothing onloaded.
    """
    add_hook_to_module(module, hook)
    if hasattr(hook, "abort"):
        hook.abort_handle = module.register_forward_hook(_aborting(hook), always_call=True)
    # accelerate's forward runs pre_forward, the call and post_forward; the lock spans them, exceptions included
    module.forward = functools.update_wrapper(functools.partial(_locked, hook.lock, module.forward), module.forward)
    for name in _hooked_methods(module):
        module.__dict__[name] = _wrap_method(module, getattr(type(module), name), hook)


def _aborting(hook: ModelHook):
    def after(module, args, output):
        if output is None:  # torch passes None when the forward raised
            hook.abort(module)

    return after


def unhook_component(module: torch.nn.Module) -> None:
    """Remove what ``hook_component`` added, leaving no trace in the module's ``__dict__``."""
    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, ModelHook):
        if getattr(hook, "abort_handle", None) is not None:
            hook.abort_handle.remove()
        remove_hook_from_module(module)
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is type(module).forward:
            del module.__dict__["forward"]
    for name in _hooked_methods(module):
        module.__dict__.pop(name, None)


def _hooked_methods(module: torch.nn.Module) -> list[str]:
    names = []
    for name in ("encode", "decode", "tiled_encode", "tiled_decode"):
        function = getattr(type(module), name, None)
        if getattr(function, "__code__", None) is _FORWARD_HOOK_CODE:
            names.append(name)
    return names


def _wrap_method(module, function, hook: ModelHook):
    # the function under `apply_forward_hook`, whose own `pre_forward(module)` would count the call twice and enter
    # a streaming hook twice; a nested call (decode -> tiled_decode) runs plain inside the outer one
    raw = getattr(function, "__wrapped__", function).__get__(module)
    inside = []

    @functools.wraps(raw)
    def wrapper(*args, **kwargs):
        with hook.lock:  # another thread's call of this component waits (pipemap.run_many)
            if inside:
                return raw(*args, **kwargs)
            inside.append(True)
            try:
                args, kwargs = hook.pre_forward(module, *args, **kwargs)
                output = raw(*args, **kwargs)
            except BaseException:
                if hasattr(hook, "abort"):
                    hook.abort(module)
                raise
            finally:
                inside.clear()
            return hook.post_forward(module, output)

    return wrapper


def _locked(lock: CallLock, forward, *args, **kwargs):
    with lock:
        return forward(*args, **kwargs)


def _check(pipe, plan: Plan) -> dict[str, torch.nn.Module]:
    check_pipeline(pipe, "dispatch")
    if not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns")
    if planned(pipe) is not None:
        raise PipelineMappedError("dispatching a pipeline that pipemap already placed")
    modules = _modules(pipe)
    for name, module in modules.items():
        if getattr(module, "_hf_hook", None) is not None:
            raise PlanMismatchError(name, f"it already carries the hook {type(module._hf_hook).__name__} (from "
                                    "enable_model_cpu_offload or a device_map); call pipe.remove_all_hooks() first")
    planned_names = {p.component for p in plan.components}
    for name in modules:
        if name not in planned_names:
            raise PlanMismatchError(name, "the pipeline has this model but the plan does not place it; re-plan from "
                                    "this pipeline (pipemap.plan(pipe, ...)) or add it to the device map")
    for name in planned_names:
        if name not in modules:
            raise PlanMismatchError(name, f"the plan places it but the pipeline has no such model (it has: "
                                    f"{', '.join(modules)})")
    _check_standins(modules, plan)
    return modules


def check_pipeline(pipe, operation: str) -> None:
    """A diffusers pipeline (anything with a ``components`` dict), or an ``ArgumentTypeError`` naming ``operation``."""
    if not isinstance(getattr(pipe, "components", None), dict):
        raise ArgumentTypeError(f"{operation}(pipe)", pipe, "a loaded diffusers pipeline (DiffusionPipeline)")


def _check_standins(modules: dict[str, torch.nn.Module], plan: Plan) -> None:
    """A plan on stand-in devices (``meta:N``) applies only to a dry run's fake weights: moving real weights to the
    meta device would destroy them."""
    from torch._subclasses.fake_tensor import FakeTensor

    for p in plan.components:
        devices = (p.device, p.execution_device, *(d for _, d, _ in p.shards))
        if any(d.startswith("meta") for d in devices):
            tensor = next(modules[p.component].parameters(), None)
            if tensor is not None and not isinstance(tensor, FakeTensor):
                raise PlanMismatchError(p.component, "the plan puts it on a dry run's stand-in device (meta), which "
                                        "holds no data: its weights would be lost. Plan for real devices")


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _undo(modules, moves: list[Move]) -> None:
    for module in modules:
        unhook_component(module)
    for moved in reversed(moves):
        moved.undo()


def _mark(pipe, plan: Plan) -> None:
    pipe.hf_device_map = plan.device_map
    pipe.__dict__["_pipemap_plan"] = plan
    for name in _GUARDED:
        pipe.__dict__[name] = _refuse(f"pipe.{name}()")
    pipe.__dict__["reset_device_map"] = functools.partial(reset, pipe)  # diffusers' own undo does ours
    from .parallel import guard_calls

    guard_calls(pipe)  # calls from several threads take turns: a call's state lives on the pipeline


def _refuse(operation: str):
    def refuse(*args, **kwargs):
        raise PipelineMappedError(operation)

    return refuse
