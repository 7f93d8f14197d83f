"""The hook every pipemap hook derives from: inputs to the component's device, outputs to the execution device.

It lives below both ``dispatch`` (which applies plans) and ``offload`` (whose hooks move weights), so neither of those
imports the other's upper half.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from accelerate.hooks import ModelHook

from .transfer import move


@dataclass
class Moved:
    """What a component's hook counted: calls, and weight bytes moved host to device and back."""

    calls: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


class CallLock:
    """A re-entrant lock a component's hook holds for the whole of each call, so calls from several threads (
    ``pipemap.run_many``) take turns on a component while different components run at once. A copy (a dry run
    deep-copies hooked modules) gets a lock of its own."""

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def __deepcopy__(self, memo) -> CallLock:
        return CallLock()


class PlacementHook(ModelHook):
    """Inputs to ``device``; outputs to the pipeline's execution device.

    ``execution_device`` is the attribute diffusers' ``DiffusionPipeline._execution_device`` reads from the first
    hooked component: it names the pipeline's execution device (where latents and embeddings live), which is why
    every pipemap hook carries that one, and the component's own device is ``device``.
    """

    def __init__(self, component: str, device: str, execution_device: str):
        self.component = component
        self.device = torch.device(device)
        self.execution_device = torch.device(execution_device)
        self.moved = Moved()
        self.lock = CallLock()

    def pre_forward(self, module, *args, **kwargs):
        self.moved.calls += 1
        return move(args, self.device), move(kwargs, self.device)

    def post_forward(self, module, output):
        return move(output, self.execution_device)

    def __repr__(self) -> str:
        return f"PlacementHook({self.component!r}, device={self.device}, execution_device={self.execution_device})"
