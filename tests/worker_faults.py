"""What a worker process imports to fail on purpose (a worker is spawned without the test's module, so the class
it unpickles must live in an importable module): a Flux attention processor that computes as Flux's own does and
raises in a worker process only (not in the process whose pid is ``PIPEMAP_TEST_CALLER``) while the file named by
``PIPEMAP_TEST_RAISE`` exists, as a worker's GPU running out of memory inside a sequence split would, the other
ranks waiting in the same collective."""

from __future__ import annotations

import os

import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor


class RaisingInWorker(FluxAttnProcessor):
    def __call__(self, *args, **kwargs):
        flag = os.environ.get("PIPEMAP_TEST_RAISE")
        if flag and os.path.exists(flag) and str(os.getpid()) != os.environ.get("PIPEMAP_TEST_CALLER"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 1 has a total "
                                         "capacity of 80 GiB (simulated, in the worker rank only)")
        return super().__call__(*args, **kwargs)
