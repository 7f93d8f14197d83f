"""``GET /metrics``: Prometheus text from a registry of the service's own (not the process-wide default, so two
services in one process, as in tests, count apart).

Bytes moved are read from ``pipemap.stats(pipe)`` at each scrape: the hooks already count them, per component; the
memory ledger's figures (activation bytes reserved per device, requests and calls waiting for memory, the moves an
out-of-memory error caused) from the service's ``admission.Admission``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..dispatch import stats
from .worker import Finished, Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds per image on a tiny CPU pipeline is milliseconds; on a 12B transformer, tens of seconds
_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


class Metrics:
    """Requests by status code, queue depth and work running, seconds per image, images, drops, bytes moved."""

    def __init__(self, pipe, worker: Worker, memory=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("pipemap_requests", "Generation requests answered, by HTTP status code", ["code"],
                                registry=self.registry)
        self.images = Counter("pipemap_images", "Images generated", registry=self.registry)
        self.seconds = Histogram("pipemap_image_seconds", "Seconds of pipeline time per image", buckets=_BUCKETS,
                                 registry=self.registry)
        Gauge("pipemap_queue_depth", "Requests waiting for the pipeline", registry=self.registry).set_function(
            lambda: worker.depth)
        Gauge("pipemap_running", "Requests the pipeline is running", registry=self.registry).set_function(
            lambda: worker.running)
        self.registry.register(_Counted(pipe, worker))
        if memory is not None:
            self.registry.register(_Memory(memory))
        self.recent_seconds_per_image: float | None = None

    def finished(self, finished: Finished) -> None:
        """Count one job the worker answered (its ``on_finished``)."""
        if finished.images:
            per_image = finished.seconds / finished.images
            self.images.inc(finished.images)
            for _ in range(finished.images):
                self.seconds.observe(per_image)
            self.recent_seconds_per_image = per_image

    def answered(self, code: int) -> None:
        self.requests.labels(code=str(code)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Counted:
    """A collector reading counters kept elsewhere at scrape time: the hooks' bytes, the worker's drops."""

    def __init__(self, pipe, worker: Worker, memory=None):
        self.pipe, self.worker = pipe, worker

    def collect(self):
        yield CounterMetricFamily("pipemap_dropped", "Requests whose work was dropped (timed out, client gone)",
                                  value=self.worker.dropped)
        family = CounterMetricFamily("pipemap_bytes_moved", "Weight bytes moved by offload and stream hooks",
                                     labels=["component", "direction"])
        for component, moved in stats(self.pipe).items():
            family.add_metric([component, "host_to_device"], moved["h2d_bytes"])
            family.add_metric([component, "device_to_host"], moved["d2h_bytes"])
        yield family

    def describe(self):
        return []


class _Memory:
    """The memory ledger read at scrape time (``admission.Admission``)."""

    def __init__(self, memory):
        self.memory = memory

    def collect(self):
        ledger = self.memory.ledger
        reserved = GaugeMetricFamily("pipemap_activation_reserved_bytes", "Activation bytes the running requests "
                                     "hold on each device", labels=["device"])
        room = GaugeMetricFamily("pipemap_activation_room_bytes", "Bytes each device has for activations beside "
                                 "the plan's weights", labels=["device"])
        for device, held in ledger.held().items():
            reserved.add_metric([device], held)
            room.add_metric([device], ledger.room(device))
        yield reserved
        yield room
        yield GaugeMetricFamily("pipemap_memory_waiting", "Requests and component calls waiting for memory now",
                                value=self.memory.waiting)
        yield CounterMetricFamily("pipemap_memory_waits", "Requests and component calls that waited for memory",
                                  value=ledger.waits)
        moves = CounterMetricFamily("pipemap_memory_moves", "Components moved to the host after an out-of-memory "
                                    "error, by device", labels=["device"])
        for device in ledger.memory:
            moves.add_metric([device], sum(len(m.moved) for m in self.memory.moves if m.device == device))
        yield moves

    def describe(self):
        return []
