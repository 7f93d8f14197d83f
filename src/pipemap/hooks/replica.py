"""Denoiser replicas (mode ``"replicated"``, strategy ``"parallel"``): a whole copy of the denoiser on each of several
GPUs; each call's batch (classifier-free guidance concatenates the unconditional and conditional halves;
``num_images_per_prompt``) is cut along its first dimension, the first part run on the home copy in the calling
thread and each other part on its own rank (``ranks.Ranks``: a worker process on its GPU by default, or a thread),
and the outputs joined in order on the home device. ``torch.nn.DataParallel`` does the same cut for a training
batch, but replicates the module at every call and gathers on one device it owns; here the copies are made once, at
dispatch, and live where the plan put them.

A rank runs under the caller's per-thread state (``CallerState`` for a thread, as ``parallel_apply``, what
``DataParallel`` runs, carries it into its threads: grad and inference mode, autocast, and on CUDA each device's
current stream, so the copies into and out of the replica are ordered after the caller's work and before what the
caller does next on its stream; ``worker.caller_state`` for a worker process). This module also holds what the
thread ranks are made of (``replica``, ``CallerState``) and the batch's cut and join.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..runtime.transfer import move, move_tensor
from .copies import CopiesHook
from .resident import PlacementHook, outside_graphs

if TYPE_CHECKING:
    from .ranks import Pending


class ReplicaHook(CopiesHook):
    """A resident denoiser with a rank on each of ``replicas``: each call's batch split across the ranks.

    The first part runs on the module itself, in the calling thread, between ``pre_forward`` and ``post_forward``;
    the other parts are submitted to the ranks in ``pre_forward`` and joined in ``post_forward``.
    """

    takes_forward = False  # the module's own forward runs the first part

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...],
                 runtime: str = "thread", asked: bool = False):
        super().__init__(component, device, execution_device, replicas, runtime, asked)
        self._pending: list[Pending | None] = []  # one entry per call in progress (a stack: calls may nest)
        self._joining = False  # post_forward runs: a failure there has cleaned up already

    def detach_hook(self, module):
        self._pending = []
        return super().detach_hook(module)

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = PlacementHook.pre_forward(self, module, *args, **kwargs)
        chunks = split_batch(args, kwargs, 1 + len(self.replica_devices))
        self._pending.append(self.live_ranks().submit(chunks[1:]) if len(chunks) > 1 else None)
        return chunks[0]

    def post_forward(self, module, output):
        pending = self._pending.pop()
        if pending is None:
            return PlacementHook.post_forward(self, module, output)
        self._joining = True
        try:
            # each part's output copied home here, where the caller uses it: from a rank's thread the copy would
            # make the caller's stream wait for the whole part at whatever point the caller had reached (G2)
            parts = [output] + [move(o, self.device) for o in pending.result()]
        finally:
            self._joining = False
        return PlacementHook.post_forward(self, module, join_batch(parts))

    def abort(self, module) -> None:
        """The home part failed (out of memory on the home GPU, say): wait for this call's other parts and drop
        them, so nothing of the call stays pending (the home part's own error is the one raised)."""
        if self._pending and not self._joining:
            pending = self._pending.pop()
            if pending is not None:
                with contextlib.suppress(Exception):
                    pending.result()

    def enter_part(self, module, *args, **kwargs):  # a submodule called directly runs on the home copy alone
        return PlacementHook.pre_forward(self, module, *args, **kwargs)

    def leave_part(self, module, output):
        return PlacementHook.post_forward(self, module, output)

    def __getstate__(self):
        return {**super().__getstate__(), "_pending": []}


def replica(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``module`` whose weights are on ``device``, copied there straight from where they are (never
    through the home GPU); on the module's own device the copy shares the weights (inference only reads them)."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) in memo:
            continue
        if tensor.device == device:
            memo[id(tensor)] = tensor
            continue
        moved = move_tensor(tensor.detach(), device)
        memo[id(tensor)] = torch.nn.Parameter(moved, requires_grad=False) if isinstance(
            tensor, torch.nn.Parameter) else moved
    copied = copy.deepcopy(module, memo)
    for name in ("_hf_hook", "_old_forward", "forward", "encode", "decode", "tiled_encode", "tiled_decode"):
        copied.__dict__.pop(name, None)  # a hooked module's traces: the copy runs its class's own methods
    return copied


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


def _run_replica(module, device: torch.device, home: torch.device | None, chunk, state: CallerState):
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


outside_graphs(ReplicaHook)
