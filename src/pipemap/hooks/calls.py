"""What a rank's call is made of, for the thread ranks (``threads.py``) and the worker processes (``workers.py``):
a copy of the component on a device (``replica``), the caller's per-thread state a call runs under
(``CallerState``), a part run under it (``run_part``), and a call's batch cut into parts and joined again
(``split_batch``, ``join_batch``: the replicated mode's, ``replica.py``).

A rank's thread runs under the caller's per-thread state, as ``torch.nn.DataParallel``'s ``parallel_apply`` carries
it into its threads: grad and inference mode, autocast, and on CUDA each device's current stream, so the copies into
and out of the rank are ordered after the caller's work and before what the caller does next on its stream.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass

import torch
from diffusers.hooks.hooks import HookRegistry
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..runtime.transfer import move, move_tensor


def replica(module: torch.nn.Module, device: torch.device, share: bool = True) -> torch.nn.Module:
    """A copy of ``module`` whose weights are on ``device``, copied there straight from where they are (never
    through the home GPU); on the module's own device the copy shares the weights (inference only reads them),
    unless ``share`` is False."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) in memo:
            continue
        if tensor.device == device and share:
            memo[id(tensor)] = tensor
            continue
        moved = move_tensor(tensor.detach(), device) if tensor.device != device else tensor.detach().clone()
        memo[id(tensor)] = torch.nn.Parameter(moved, requires_grad=False) if isinstance(
            tensor, torch.nn.Parameter) else moved
    copied = copy.deepcopy(module, memo)
    for name in ("_hf_hook", "_old_forward", "forward", "encode", "decode", "tiled_encode", "tiled_decode"):
        copied.__dict__.pop(name, None)  # a hooked module's traces: the copy runs its class's own methods
    return copied


def rank_copy(module: torch.nn.Module, device: torch.device, share: bool = True) -> torch.nn.Module:
    """A copy that a thread rank runs (``threads.ThreadRanks``): ``replica`` with the diffusers hooks of each of its
    modules registered anew over it (``own_diffusers_hooks``). Not for a worker's copy, which is pickled without
    them: re-registering runs each hook's ``initialize_hook`` once more, on weights the copy may share."""
    copied = replica(module, device, share)
    for sub in copied.modules():
        own_diffusers_hooks(sub)
    return copied


def own_diffusers_hooks(module: torch.nn.Module) -> None:
    """The diffusers hooks of a deep-copied ``module`` (layerwise casting, caches: ``diffusers.hooks.HookRegistry``)
    registered anew over the copy. A deep copy keeps the forward diffusers wrapped in a closure, which still calls
    the original module's hooks and forward: the copy would cast and read the original's weights (a race with the
    original's own call, and the copy's weights never cast)."""
    registry = module.__dict__.get("_diffusers_hook")
    if registry is None:
        return
    hooks = [(name, registry.hooks[name]) for name in registry._hook_order]  # the hooks' deep copies, in order
    module.__dict__.pop("forward", None)
    del module._diffusers_hook
    fresh = HookRegistry.check_if_exists_or_initialize(module)
    for name, hook in hooks:
        fresh.register_hook(hook, name)


def version_of(x) -> int | None:
    """A tensor's version counter (moved by every in-place write), or None: not a tensor, or an inference-mode one,
    which keeps none."""
    if not isinstance(x, torch.Tensor):
        return None
    try:
        return x._version
    except RuntimeError:
        return None


def casts_in_place(module: torch.nn.Module) -> bool:
    """Whether diffusers' layerwise casting is on ``module``: its hooks cast the weights in place around each call,
    so a rank whose copy shares them (a rank on the module's own device: a plan remapped onto one device) would read
    them half cast while another rank runs."""
    return any("layerwise_casting" in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})
               for m in module.modules())


@dataclass(frozen=True)
class CallerState:
    """What PyTorch keeps per thread that a replica's thread must share with the caller's."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each autocast the caller runs under
    autocast_cache: bool
    streams: tuple = ()  # the caller's current stream on each CUDA device of the call

    @classmethod
    def capture(cls, devices) -> CallerState:
        autocast = tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                         if torch.is_autocast_enabled(kind))
        cuda = torch.cuda.is_available()
        streams = tuple(torch.cuda.current_stream(d) for d in dict.fromkeys(devices) if d.type == "cuda" and cuda)
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
                   torch.is_autocast_cache_enabled(), streams)

    @contextlib.contextmanager
    def entered(self, device: torch.device):
        """This state in the running thread, ``device`` its current CUDA device."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.inference:
                stack.enter_context(torch.inference_mode())
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=self.autocast_cache))
            for stream in self.streams:  # each sets its device current: the replica's device comes last
                stack.enter_context(torch.cuda.stream(stream))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            yield


def run_part(module, device: torch.device, home: torch.device | None, chunk, state: CallerState):
    # the inputs are on ``device`` already (moved in the caller's thread, ``ReplicaHook.pre_forward`` and guidance's
    # ``_on_copy``): this ``move`` is then a no-op. With ``home`` None the output stays on ``device`` and the caller
    # copies it home where it uses it; else the copy out runs here, and the caller's stream waits for it
    with state.entered(device):
        args, kwargs = move(chunk, device)
        output = module(*args, **kwargs)
        return output if home is None else move(output, home)


def _batched(leaf, batch: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch


def split_batch(args: tuple, kwargs: dict, parts: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` cut into up to ``parts`` calls along the batch: the first dimension of the first tensor
    that has one (the latents); every tensor of that first dimension is cut, everything else goes whole to each."""
    leaves, spec = tree_flatten((args, kwargs))
    batch = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), 0)
    parts = min(parts, batch)
    if parts < 2:
        return [(args, kwargs)]
    pieces = [leaf.tensor_split(parts) if _batched(leaf, batch) else [leaf] * parts for leaf in leaves]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


def join_batch(outputs: list):
    """The outputs of the parts of a call as one output: every tensor concatenated along the batch, in order."""
    flat = [tree_flatten(o)[0] for o in outputs]
    first, spec = tree_flatten(outputs[0])
    joined = [torch.cat([f[i] for f in flat]) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
              for i, leaf in enumerate(first)]
    return tree_unflatten(joined, spec)
