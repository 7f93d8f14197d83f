"""What offload and stream share (``hooks/moving.py``): the ``Ledger`` of what one dispatch holds where, the
``LruCache`` that keeps offloaded components on a device while its room allows, and, for both modes, a placed
pipeline run on the CPU (GPU plans remapped) equal to plain diffusers and a failed call leaving nothing onloaded."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import moving, pipeline_state, plain_pipeline, run
from pipemap import tiny
from pipemap.dispatch import onload_peaks
from pipemap.hooks import Ledger
from pipemap.hooks.moving import LruCache, SharedCache
from pipemap.planner import forcing_hardware
from pipemap.runtime import streams

MODES = {"balanced_low_memory": "offload", "balanced_ultra_low_memory": "stream"}


class Boom(RuntimeError):
    pass


def _fail_once(module: torch.nn.Module, after: int):
    """A pre-hook on ``module`` that raises at its ``after``-th call, once (an out-of-memory error, say)."""
    calls = []

    def hook(mod, args):
        calls.append(1)
        if len(calls) == after:
            raise Boom("simulated out of memory")

    return module.register_forward_pre_hook(hook)


@pytest.mark.slow  # over 2 s: out of the quick subset
@pytest.mark.parametrize("strategy", list(MODES))
@pytest.mark.parametrize("kind", tiny.KINDS)
def test_output_equals_plain_and_reset_restores(tiny_folders, reference_outputs, kind, strategy):
    pipe = plain_pipeline(tiny_folders[kind])
    gpu_plan = pipemap.plan(pipe, hardware=forcing_hardware(pipemap.inspect(pipe), strategy, 1), strategy=strategy,
                            headroom=0.0)
    assert {p.mode for p in gpu_plan.components} == {"resident", MODES[strategy]}
    assert all(d.used <= d.budget for d in gpu_plan.devices)
    run(pipe, kind)  # transformers installs hooks of its own at the first call
    before = pipeline_state(pipe)
    pipemap.dispatch(pipe, gpu_plan.remap({"cuda:0": "cpu"}))
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    moved = pipemap.stats(pipe)
    for p in gpu_plan.components:
        assert (moved[p.component]["h2d_bytes"] > 0) == (p.mode != "resident"), p.component
        assert moved[p.component]["d2h_bytes"] == 0 and moved[p.component]["calls"] > 0
    # in the accounting: residents plus what was onloaded at once stay within the GPU's budget (give or take the
    # non-persistent buffers, position_ids, which no header lists: 616 bytes a text encoder)
    resident = sum(p.bytes for p in gpu_plan.components if p.mode == "resident")
    assert resident + onload_peaks(pipe)["cpu"] <= gpu_plan.devices[0].budget + 4096
    pipemap.reset(pipe)
    assert pipeline_state(pipe) == before
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["offload", "stream"])
def test_a_failed_call_leaves_nothing_onloaded(tiny_folders, reference_outputs, sd_plan, sd_inventory, mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = moving(sd_plan, sd_inventory, {"unet": (mode, "cuda:0")}).remap({"cuda:0": "cpu", "cuda:1": "cpu"})
    pipemap.dispatch(pipe, plan)
    hook = pipe.unet._hf_hook
    run(pipe, "sd")
    first = pipemap.stats(pipe, reset=True)["unet"]
    live = dict(hook.ledger.live)
    handle = _fail_once(pipe.unet.up_blocks[1], after=2)  # in the second step, half way through the unet
    with pytest.raises(Boom):
        run(pipe, "sd")
    handle.remove()
    groups = [hook.group] if mode == "offload" else [hook.root, *hook.blocks]
    # offload: the unet kept onloaded after the first call is evicted too; stream: nothing stays between calls
    kept = first["h2d_bytes"] if mode == "offload" else 0
    assert not any(g.loaded for g in groups) and hook.ledger.live["cpu"] <= live["cpu"] - kept
    pipemap.stats(pipe, reset=True)
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    # the next call onloads what the first did (offload: once, as the first; stream: every block, as every call)
    assert pipemap.stats(pipe)["unet"] == first
    pipemap.reset(pipe)


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
    """What ``LruCache`` asks of an offload hook: its group's size, its ledger, whether it runs, onload and evict."""

    busy = False

    def __init__(self, name: str, size: int, log: list, ledger=None):
        self.name, self.log, self.ledger = name, log, ledger
        self.group = type("Group", (), {"nbytes": size, "layout": type("Layout", (), {"nbytes": size})})()

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


def test_a_hold_evicts_other_pipelines_idle_members_and_counts_against_their_room():
    # a stream hook's buffers (``hold``) make room by evicting what other pipelines keep, least recently used
    # first, never a running one nor its own pipeline's (its plan put its buffers beside them: issue 39)
    log: list[str] = []
    mine, theirs = object(), object()
    cache = LruCache(100)
    own, a, b = FakeHook("own", 30, log, mine), FakeHook("a", 30, log, theirs), FakeHook("b", 30, log, theirs)
    for hook in (a, own, b):
        cache.use(hook)
    b.busy = True
    streaming = FakeHook("stream", 50, log, mine)
    cache.hold(streaming, 50)  # 90 + 50 > 100 and its own 30 stay: a leaves (60 + 50 > 100), b runs, so stays
    assert log[-1] == "-a" and list(cache.loaded) == [own, b, streaming]
    assert cache.taken(mine) == 60 and cache.taken(theirs) == 110 and cache.over(theirs) and not cache.over(mine)
    b.busy = False
    cache.use(FakeHook("c", 30, log, theirs))  # its pipeline counts the other's buffers: b and own leave
    assert log[-3:] == ["-own", "-b", "+c"] and list(cache.loaded)[0] is streaming
    cache.hold(streaming, 0)  # its call ended, keeping nothing
    assert streaming not in cache.loaded and not cache.holding


def test_lru_cache_drop_forgets_without_evicting():
    log: list[str] = []
    cache, a = LruCache(100), FakeHook("a", 60, log)
    cache.use(a)
    cache.drop(a)
    cache.drop(a)  # twice: no error
    cache.use(FakeHook("b", 60, log))  # a is no longer counted, so nothing is evicted
    assert log == ["+a", "+b"]


def test_placed_pipelines_share_each_gpus_cache_and_evict_each_others_components(fake_cuda):
    log: list[str] = []
    first, second = Ledger(shared=True), Ledger(shared=True)
    cache = first.cache("cuda:0", 100)
    assert isinstance(cache, SharedCache) and second.cache("cuda:0", 80) is cache and first.lock is second.lock
    # the dry run's ledgers and the CPU keep their own
    assert Ledger().cache("cuda:0", 100) is not cache and first.cache("cpu", 100) is not cache
    a, b = FakeHook("a", 60, log), FakeHook("b", 40, log)
    cache.join(a, 100)
    cache.join(b, 80)
    assert cache.room == 80  # the smallest room: the plan made last saw the other's resident weights
    cache.use(a)
    cache.use(b)  # 60 + 40 > 80: the other ledger's a leaves
    assert log == ["+a", "-a", "+b"] and list(cache.loaded) == [b]
    cache.drop(b)  # b's pipeline reset: its entries and its room leave, a's stay
    cache.leave(b)
    assert cache.room == 100
    cache.use(a)
    assert list(cache.loaded) == [a]
