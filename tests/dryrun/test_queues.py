"""dryrun/queues.py: the copy queues on stand-in devices. The buffers offload and stream hooks onload weights into
count as weights in the dry run's tracker (plain model queues' buffers would read as activations), and the queues
still model the device's memory as ``streams.ModelQueues`` does."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import pipemap
from pipemap.dryrun.queues import StandinQueues
from pipemap.dryrun.trackers import StorageTracker
from pipemap.planner import forcing_hardware
from pipemap.runtime.streams import ModelQueues

DEVICE = torch.device("meta:1")


def test_standin_queue_buffers_count_as_weights():
    tracker = StorageTracker()
    queues = StandinQueues(DEVICE, tracker)
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        buffer = queues.alloc(4096)
        assert isinstance(buffer, FakeTensor) and buffer.device == DEVICE and buffer.dtype == torch.uint8
        assert tracker.weight_live["meta:1"] == tracker.live["meta:1"] == 4096
        scratch = torch.empty(100, dtype=torch.uint8, device=DEVICE)  # allocated outside: an activation
    assert tracker.weight_peak["meta:1"] == 4096 and tracker.activation_peak["meta:1"] == 100
    assert queues.held == queues.peak == 4096  # the model of the device's allocator sees it too
    queues.free(buffer)
    del buffer, scratch
    assert queues.held == 0 and tracker.live["meta:1"] == tracker.weight_live["meta:1"] == 0


def test_plain_model_queue_buffers_would_read_as_activations():
    tracker = StorageTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        buffer = ModelQueues(DEVICE).alloc(4096)
    assert tracker.weight_peak["meta:1"] == 0 and tracker.activation_peak["meta:1"] == 4096
    del buffer


def test_only_the_buffer_counts_as_weights_not_what_follows():
    tracker = StorageTracker()
    queues = StandinQueues(DEVICE, tracker)
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        first = queues.alloc(1000)
        after = torch.empty(10, dtype=torch.uint8, device=DEVICE)
        second = queues.alloc(500)
    assert tracker.weight_peak["meta:1"] == 1500 and tracker.activation_peak["meta:1"] == 10
    del first, after, second


@pytest.mark.slow
def test_an_offloaded_components_onloaded_weights_are_weights_in_the_report(tiny_folders):
    folder = tiny_folders["sd"]
    hardware = forcing_hardware(pipemap.inspect(folder), "balanced_low_memory")
    plan = pipemap.plan(folder, hardware=hardware, strategy="balanced_low_memory", headroom=0.0)
    offloaded = {p.component: p for p in plan.components if p.mode == "offload"}
    assert "vae" in offloaded and offloaded["vae"].execution_device == "cuda:0"
    # the figures only: no tiling advice, a second dry run here (its own test: tests/dryrun/test_trackers.py)
    report = pipemap.simulate(folder, plan, height=32, width=32, advice=False)
    assert report.ok, report.error
    # resident weights, then the VAE onloaded into the queues' buffers at its call: weights too, not activations
    assert report.weight_peak_bytes["cuda:0"] - report.weight_bytes["cuda:0"] >= offloaded["vae"].bytes
    assert report.activation_bytes["cuda:0"] < offloaded["vae"].bytes
