"""The copy queues of a dry run: ``streams.ModelQueues`` on stand-in devices, whose buffers for onloaded weights the
dry run's tracker counts as weights (not activations)."""

from __future__ import annotations

import torch

from ..streams import ModelQueues
from .trackers import StorageTracker


class StandinQueues(ModelQueues):
    """``ModelQueues`` that tell ``tracker`` which allocations hold weights."""

    def __init__(self, device: torch.device, tracker: StorageTracker):
        super().__init__(device)
        self.tracker = tracker

    def alloc(self, nbytes: int) -> torch.Tensor:
        with self.tracker.allocating_weights():
            return super().alloc(nbytes)
