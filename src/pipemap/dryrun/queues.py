"""The copy queues of a dry run: ``streams.ModelQueues`` on stand-in devices, whose buffers for onloaded weights the
dry run's tracker counts as weights (not activations), and which tell it the host copies left in their files (the
disk tier: counted on ``disk``, not the CPU)."""

from __future__ import annotations

import torch

from ..runtime.streams import ModelQueues
from .trackers import StorageTracker


class StandinQueues(ModelQueues):
    """``ModelQueues`` that tell ``tracker`` which allocations hold weights."""

    def __init__(self, device: torch.device, tracker: StorageTracker):
        super().__init__(device)
        self.tracker = tracker

    def alloc(self, nbytes: int) -> torch.Tensor:
        with self.tracker.allocating_weights():
            return super().alloc(nbytes)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        with self.tracker.allocating_weights():  # a staging buffer: pinned RAM a plan counts
            return super().alloc_host(nbytes)

    def on_disk(self, tensors) -> None:
        self.tracker.on_disk(tensors)
