"""serve/metrics.py: ``GET /metrics``'s Prometheus text, from a registry of the service's own. Images and seconds per
image from the jobs the worker finished, requests by status code, the queue's depth, work running and drops read
live from the worker, and bytes moved read from the hooks' counters at each scrape."""

from __future__ import annotations

import pytest

import pipemap

pytest.importorskip("prometheus_client", reason="pipemap serve needs prometheus_client: pip install -e '.[serve]'")
from pipemap.serve.metrics import Metrics  # noqa: E402
from pipemap.serve.worker import Finished, Job, Worker  # noqa: E402
from serving import STEPS, Echo, samples  # noqa: E402


def _metrics(pipe=None) -> tuple[Metrics, Worker]:
    pipe = pipe or Echo()
    worker = Worker(pipe, max_queue=8)  # never started: jobs stay waiting
    return Metrics(pipe, worker), worker


def test_finished_jobs_count_images_and_seconds_per_image():
    metrics, _ = _metrics()
    metrics.finished(Finished(images=2, seconds=1.0))
    metrics.finished(Finished(images=0, seconds=5.0))  # a failed job: nothing made, nothing timed
    counted = samples(metrics.text().decode())
    assert counted["pipemap_images_total"] == 2
    assert counted["pipemap_image_seconds_count"] == 2 and counted["pipemap_image_seconds_sum"] == 1.0
    assert counted['pipemap_image_seconds_bucket{le="0.3"}'] == 0
    assert counted['pipemap_image_seconds_bucket{le="1.0"}'] == 2  # 0.5 s each
    assert metrics.recent_seconds_per_image == 0.5


def test_answers_are_counted_by_status_code():
    metrics, _ = _metrics()
    for status in (200, 200, 429, 504):
        metrics.answered(status)
    counted = samples(metrics.text().decode())
    assert {k: v for k, v in counted.items() if k.startswith("pipemap_requests_total")} == {
        'pipemap_requests_total{code="200"}': 2, 'pipemap_requests_total{code="429"}': 1,
        'pipemap_requests_total{code="504"}': 1}


def test_queue_depth_running_and_drops_are_read_from_the_worker_at_each_scrape():
    metrics, worker = _metrics()
    jobs = [Job({"prompt": str(i)}, 0, 1, float("inf")) for i in range(3)]
    for job in jobs:
        worker.submit(job)
    worker.taken.add(Job({"prompt": "run"}, 0, 1, float("inf")))  # as the worker's thread takes a job
    counted = samples(metrics.text().decode())
    assert (counted["pipemap_queue_depth"], counted["pipemap_running"], counted["pipemap_dropped_total"]) == (3, 1, 0)
    worker.taken.add(Job({"prompt": "read ahead"}, 0, 1, float("inf")))  # one worker: the runner holds it waiting
    counted = samples(metrics.text().decode())
    assert (counted["pipemap_queue_depth"], counted["pipemap_running"]) == (4, 1)
    worker.cancel(jobs[0])
    counted = samples(metrics.text().decode())
    assert (counted["pipemap_queue_depth"], counted["pipemap_dropped_total"]) == (3, 1)


def test_two_services_in_one_process_count_apart():
    first, _ = _metrics()
    second, _ = _metrics()
    first.answered(200)
    first.finished(Finished(images=1, seconds=0.1))
    counted = samples(second.text().decode())
    assert 'pipemap_requests_total{code="200"}' not in counted and counted["pipemap_images_total"] == 0


def test_bytes_moved_are_the_hooks_own_counts_per_component_and_direction(service):
    service.pipe(prompt="a cat", num_inference_steps=STEPS, height=32, width=32)
    moved = pipemap.stats(service.pipe)
    counted = samples(service.metrics.text().decode())
    offloaded = [p.component for p in service.plan.components if p.mode == "offload"]
    assert offloaded
    for component, figures in moved.items():
        labels = f'component="{component}",direction='
        assert counted[f'pipemap_bytes_moved_total{{{labels}"host_to_device"}}'] == figures["h2d_bytes"]
        assert counted[f'pipemap_bytes_moved_total{{{labels}"device_to_host"}}'] == figures["d2h_bytes"]
    assert all(moved[c]["h2d_bytes"] > 0 for c in offloaded)
