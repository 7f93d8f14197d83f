"""What offload and stream share (``hooks/moving.py``): the ``Ledger`` of what one dispatch holds where, and the
``LruCache`` that keeps offloaded components on a device while its room allows."""

from __future__ import annotations

import torch

from pipemap import streams
from pipemap.hooks import Ledger
from pipemap.hooks.moving import LruCache


def test_ledger_counts_live_bytes_and_keeps_each_devices_peak():
    ledger = Ledger()
    for device, size in [("cuda:0", 100), ("cuda:0", 50), ("cuda:1", 30), ("cuda:0", -120), ("cuda:0", 40)]:
        ledger.add(device, size)
    assert ledger.live == {"cuda:0": 70, "cuda:1": 30}
    assert ledger.peak == {"cuda:0": 150, "cuda:1": 30}


def test_ledger_keeps_one_cache_per_device_and_room_and_one_queues_per_device():
    made = []

    def queues(device):
        made.append(device)
        return streams.ModelQueues(device)

    ledger = Ledger(queues)
    assert ledger.cache("cpu", 100) is ledger.cache("cpu", 100)
    assert ledger.cache("cpu", 200) is not ledger.cache("cpu", 100) and ledger.cache("cpu", 200).room == 200
    cpu = ledger.queues(torch.device("cpu"))
    assert ledger.queues(torch.device("cpu")) is cpu and isinstance(cpu, streams.ModelQueues)
    assert made == [torch.device("cpu")]  # made once, when first asked for
    assert isinstance(Ledger().queues(torch.device("cpu")), streams.ModelQueues)  # the default: queues_for


class FakeHook:
    """What ``LruCache`` asks of an offload hook: its group's size, and onload and evict."""

    def __init__(self, name: str, size: int, log: list):
        self.name, self.log = name, log
        self.group = type("Group", (), {"layout": type("Layout", (), {"nbytes": size})})()

    def onload(self):
        self.log.append(f"+{self.name}")

    def evict(self):
        self.log.append(f"-{self.name}")


def test_lru_cache_evicts_the_least_recently_used_first():
    log: list[str] = []
    cache = LruCache(100)
    a, b, c = (FakeHook(n, 40, log) for n in "abc")
    cache.use(a)
    cache.use(b)
    cache.use(a)  # already onloaded: nothing moves, and a becomes the most recently used
    assert log == ["+a", "+b"]
    cache.use(c)  # 40 + 40 + 40 > 100: b, the least recently used, leaves
    assert log == ["+a", "+b", "-b", "+c"] and list(cache.loaded) == [a, c]
    big = FakeHook("big", 100, log)
    cache.use(big)  # room only for itself: every other leaves, oldest first
    assert log[-3:] == ["-a", "-c", "+big"] and list(cache.loaded) == [big]


def test_lru_cache_drop_forgets_without_evicting():
    log: list[str] = []
    cache, a = LruCache(100), FakeHook("a", 60, log)
    cache.use(a)
    cache.drop(a)
    cache.drop(a)  # twice: no error
    cache.use(FakeHook("b", 60, log))  # a is no longer counted, so nothing is evicted
    assert log == ["+a", "+b"]
