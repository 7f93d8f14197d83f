"""The copy queues and their model (``pipemap.runtime.streams``): memory bounded whatever the host runs ahead, waits
checked, buffers not reused while in use, frees held until the copies into them are done."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pipemap
from pipemap.dryrun.trackers import StorageTracker
from pipemap.hooks import Ledger
from pipemap.runtime import streams


@pytest.fixture
def model_queues(monkeypatch) -> list[streams.ModelQueues]:
    """Every stream model a dispatch makes, kept for the test to read."""
    made = []
    original = Ledger.queues

    def keep(self, device):
        queues = original(self, device)
        if all(q is not queues for q in made):
            made.append(queues)
        return queues

    monkeypatch.setattr(Ledger, "queues", keep)
    return made


# ---- memory bounded by construction ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, None])  # the GPU keeps up; the GPU does nothing until the host waits
def test_held_bytes_stay_within_the_charge_whatever_the_host_runs_ahead(tiny_folders, sd_plan, model_queues,
                                                                        monkeypatch, lag):
    monkeypatch.setattr(streams.ModelQueues, "lag", lag)
    report = pipemap.simulate(tiny_folders["sd"], sd_plan)
    assert report.ok, report.error
    charges = {gpu: max(p.room + p.resident_bytes for p in sd_plan.components if p.execution_device == gpu)
               for gpu in ("cuda:0", "cuda:1")}
    assert {str(q.device) for q in model_queues} == {"meta:0", "meta:1"}
    for queues in model_queues:
        gpu = f"cuda:{queues.device.index}"
        assert 0 < queues.peak <= charges[gpu], (gpu, queues.peak, charges)  # allocated plus pending frees
        assert queues.held == 0 and not queues.pending_frees
        # the dry run's own peak, storages counted as they live: no weights on the GPU beside those of the plan
        assert report.weight_peak_bytes[gpu] <= charges[gpu]


def test_a_block_used_before_its_copy_is_waited_for_fails_the_dry_run(tiny_folders, sd_plan, monkeypatch):
    monkeypatch.setattr(streams.ModelQueues, "wait", lambda self, event: None)
    report = pipemap.simulate(tiny_folders["sd"], sd_plan)
    assert not report.ok
    assert "before the compute queue waited for its copy" in report.error.message
    block = report.error.message.split("'")[1]  # the block named: a streamed component's block path
    component, _, path = block.partition(".")
    assert component in ("text_encoder", "unet", "vae") and path


def test_a_copy_into_a_buffer_still_in_use_is_refused():
    queues = streams.ModelQueues(torch.device("cpu"))
    buffer, source = queues.alloc(8), torch.arange(8, dtype=torch.uint8)
    last_use = queues.record(buffer)  # the compute queue read it until here
    queues.copy([(buffer, source)], after=last_use, name="unet.up_blocks.0")  # fine: waits for that use
    queues.record(buffer)
    with pytest.raises(streams.BufferReuseError, match="unet.up_blocks.1"):
        queues.copy([(buffer, source)], name="unet.up_blocks.1")


def test_memory_freed_while_a_copy_may_still_write_stays_held_in_the_dry_run_peak():
    mode, tracker = FakeTensorMode(allow_non_fake_inputs=True), StorageTracker()
    queues = streams.ModelQueues(torch.device("meta:0"))
    with mode, tracker:
        source = torch.empty(1000, dtype=torch.uint8)
        first = queues.alloc(1000)
        queues.copy([(first, source)], side=True)  # never waited for
        queues.free(first)
        del first
        second = queues.alloc(1000)  # the caching allocator cannot hand it the first buffer's memory
        assert queues.held == queues.peak == 2000 == tracker.live["meta:0"]
        queues.synchronize()  # the copy done: the first buffer's memory is free
        assert queues.held == 1000 == tracker.live["meta:0"]
        queues.free(second)
    assert queues.held == 0 and tracker.peak["meta:0"] == 2000
