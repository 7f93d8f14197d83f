"""The CUDA-only code (streams.CudaQueues, the offload and stream hooks with CUDA on, pinning through cudart) run on
the CPU under the test suite's fake CUDA (tests/fakecuda.py) and its happens-before checker.

Scenarios 1-5 are what pipemap does itself (one thread, the default stream): no race expected. 5b: an out-of-memory
error in a buffer's allocation must leave the ledger as it was. 6, 7, 7b break an ordering on purpose (a copy that
does not wait for the buffer's last use; a block that does not wait for its copy; fresh buffers without the event
at their allocation): races expected, which shows the checker sees what it should. 8: the same components called
from two threads with different current streams (a caller under ``with torch.cuda.stream(s)``): weights kept from
the first call (resident pieces, an offloaded component still cached) must be waited for on the second stream.
9: ``reset`` right after a call whose result the host never waited for: pinned memory must not be unregistered
with a copy out of it in flight.

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/cuda_ordering.py
"""

from __future__ import annotations

import threading

import torch

import fakecuda

fake = fakecuda.install()

from pipemap.hooks import HOOKS, Ledger, hook_component, stream, unhook_component  # noqa: E402
from pipemap.plan import Placement  # noqa: E402
from pipemap.runtime import streams  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, widths=(8, 16, 8, 24, 8, 8), boom_at=None):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(widths[0]))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.boom_at = boom_at

    def forward(self, x):
        x = x * self.scale
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.boom_at == i:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return x


def streamed(net, name="unet", depth=None, resident=()):
    if depth is None:
        return Placement(name, "cpu", 1, "stream", "cuda:0", 10)
    paths = [f"blocks.{i}" for i in range(len(net.blocks))]
    sizes = [sum(p.numel() * 4 for p in net.blocks[i].parameters()) for i in range(len(paths))]
    return Placement(name, "cpu", 1, "stream", "cuda:0", 10, (), tuple(zip(paths, sizes)), tuple(resident), 0, depth)


def hooked(net, placement, ledger):
    hook = HOOKS[placement.mode](placement, "cuda:0", ledger)
    hook_component(net, hook)
    assert type(hook.queues).__name__ == "CudaQueues", hook.queues
    return hook


def call(net, n=3):
    x = torch.ones(2, net.blocks[0].in_features, device="cuda:0")  # inputs already on the GPU: no host sync
    return [net(x) for _ in range(n)]


def report(title: str) -> bool:
    races = list(dict.fromkeys(str(r) for r in fake.races))
    print(f"{title}: {len(races)} race(s)")
    for line in races[:3]:
        print("    race:", line)
    fake.races.clear()
    return not races


results = {}

# 1. a streamed component, default depth, blocks of several sizes sharing depth+1 buffers, three calls
net, ref = Net(), Net()
ref.load_state_dict(net.state_dict())
hooked(net, streamed(net), Ledger())
outs = call(net)
assert all(torch.equal(o.cpu(), ref(torch.ones(2, 8))) for o in outs)
results[1] = report("1 stream, depth 1, 3 calls")

# 2. depth 2 with one resident block, the planner's form (blocks, resident_blocks, prefetch)
net2 = Net(widths=(8, 32, 8, 32, 8, 32, 8))
hooked(net2, streamed(net2, "transformer", depth=2, resident=("blocks.1",)), Ledger())
call(net2)
results[2] = report("2 stream, depth 2, a resident block")

# 3. two offloaded components sharing one GPU's room (each call evicts the other; memory reused at once)
ledger = Ledger()
a, b = Net(widths=(8, 64, 8)), Net(widths=(8, 48, 8))
room = max(sum(p.numel() * 4 for p in m.parameters()) for m in (a, b)) + 256
hooked(a, Placement("a", "cpu", 1, "offload", "cuda:0", room), ledger)
hooked(b, Placement("b", "cpu", 1, "offload", "cuda:0", room), ledger)
for _ in range(3):
    call(a, 1)
    call(b, 1)
results[3] = report("3 two offloaded components evicting each other")

# 4. an offloaded and a streamed component on one GPU: the offload buffer's memory serves the stream buffers
ledger = Ledger()
c, d = Net(widths=(8, 96, 8)), Net()
hc = hooked(c, Placement("c", "cpu", 1, "offload", "cuda:0", sum(p.numel() * 4 for p in c.parameters()) + 64),
            ledger)
hooked(d, Placement("d", "cpu", 1, "stream", "cuda:0", 10), ledger)
for _ in range(3):
    call(c, 1)
    hc.cache.drop(hc)
    hc.evict()  # as the LRU would when room runs out
    call(d, 1)
results[4] = report("4 offload evicted, then a streamed component on its memory")

# 5. an out-of-memory error inside block 2 of a streamed call, then more calls
e = Net()
he = hooked(e, streamed(e), Ledger())
call(e, 1)
e.boom_at = 2
try:
    call(e, 1)
except torch.OutOfMemoryError:
    pass
e.boom_at = None
call(e, 2)
print("   after the failure: depth", he.depth, "buffers", len(he.buffers), "live", dict(he.ledger.live))
results[5] = report("5 OOM mid-call, then 2 calls")

# 5b. the out-of-memory error in a buffer's allocation itself: the ledger must not keep counting that buffer
e2 = Net()
he2 = hooked(e2, streamed(e2), Ledger())
call(e2, 1)
fake.limit[0] = fake.allocated.get(0, 0) + 1024  # the next buffers do not fit: the allocator raises
try:
    call(e2, 1)
except torch.OutOfMemoryError:
    pass
fake.limit.clear()
print("5b OOM in a buffer allocation: ledger live after the failed call", dict(he2.ledger.live), "(0 expected)")
results["5b"] = not any(he2.ledger.live.values())
call(e2, 1)
results["5b"] &= report("5b after it, one more call")

# 6. mutation: a prefetch copy that does not wait for the buffer's last use
real_fill = stream.StreamHook._fill


def fill_without_after(self, index, buffer):
    _, buffer.copied = self._onload(self.blocks[index], buffer.tensor, after=None, side=True)
    buffer.block = index
    return buffer


stream.StreamHook._fill = fill_without_after
f = Net()
hooked(f, streamed(f), Ledger())
call(f, 2)
stream.StreamHook._fill = real_fill
results[6] = not report("6 MUTATION copy without `after` (races expected)")

# 7. mutation: blocks run without waiting for their copy
real_wait = streams.CudaQueues.wait
streams.CudaQueues.wait = lambda self, event: None
g = Net()
hooked(g, streamed(g), Ledger())
call(g, 2)
streams.CudaQueues.wait = real_wait
results[7] = not report("7 MUTATION no wait before use (races expected)")

# 7b. mutation: fresh buffers without the event at their allocation (their memory served the compute stream until
#     then; the first copy into them must wait for that point): caught through the allocator's stream-ordered reuse
real_record = streams.CudaQueues.record


def record_nothing_for_fresh(self, buffer=None):
    return None if getattr(self, "fresh", False) else real_record(self, buffer)


real_begin = stream.StreamHook._buffer_sizes


def sizes_marking_fresh(self):
    self.queues.fresh = True  # the records _begin makes right after allocating are dropped
    return real_begin(self)


real_prefetch = stream.StreamHook._prefetch


def prefetch_unmarking(self, index):
    self.queues.fresh = False
    return real_prefetch(self, index)


stream.StreamHook._buffer_sizes, stream.StreamHook._prefetch = sizes_marking_fresh, prefetch_unmarking
streams.CudaQueues.record = record_nothing_for_fresh
ledger = Ledger()
c2, d2 = Net(widths=(8, 96, 8)), Net()
hc2 = hooked(c2, Placement("c", "cpu", 1, "offload", "cuda:0", 10**6), ledger)
hooked(d2, Placement("d", "cpu", 1, "stream", "cuda:0", 10), ledger)
for _ in range(3):
    call(c2, 1)
    hc2.cache.drop(hc2)
    hc2.evict()
    call(d2, 1)
stream.StreamHook._buffer_sizes, stream.StreamHook._prefetch = real_begin, real_prefetch
streams.CudaQueues.record = real_record
results["7b"] = not report("7b MUTATION no event at buffer allocation (races expected)")

# 8. two threads with different current streams (a resident block kept from the first call; an offloaded component
#    left in its LRU cache)
ledger = Ledger()
h = Net(widths=(8, 32, 8, 32, 8, 32, 8))
hooked(h, streamed(h, "transformer", depth=1, resident=("blocks.1", "blocks.3")), ledger)
k = Net(widths=(8, 64, 8))
hooked(k, Placement("text_encoder", "cpu", 1, "offload", "cuda:0", 10**6), ledger)
user = torch.cuda.Stream("cuda:0")


def first():  # thread A: default stream
    call(h, 1)
    call(k, 1)


def second():  # thread B: runs under its own current stream, as `with torch.cuda.stream(s): pipe(...)` would
    with torch.cuda.stream(user):
        call(h, 1)
        call(k, 1)


for target in (first, second):
    t = threading.Thread(target=target)
    t.start()
    t.join()
results[8] = report("8 same components, two threads, different current streams")

# 9. reset right after a call whose output the host never waited for (output_type="pt" or "latent"): pinned memory
#    must not be unregistered (and freed) with the copy out of it possibly still queued
for mode in ("offload", "stream"):
    m = Net(widths=(8, 64, 8))
    placement = Placement("vae", "cpu", 1, "offload", "cuda:0", 10**6) if mode == "offload" else streamed(m, "vae")
    hooked(m, placement, Ledger())
    call(m, 1)  # no synchronisation: the host returned while the GPU may still be copying
    unhook_component(m)  # what pipemap.reset(pipe) does per component
    results[f"9{mode}"] = report(f"9 reset right after a call, {mode}")

print("\nregistered now:", len(fake.registered), "host buffers,", sum(fake.registered.values()), "bytes")
own = all(results[k] for k in (1, 2, 3, 4, 5, "5b"))
caught = all(results[k] for k in (6, 7, "7b"))
print("pipemap's own orderings (1-5, 5b) clean:", own, "| the checker catches the mutations (6, 7, 7b):", caught)
print("8 (caller-chosen streams) clean:", results[8], "| 9 (reset right after a call) clean:",
      results["9offload"] and results["9stream"])
fake.exit()
raise SystemExit(0 if own and caught and results[8] and results["9offload"] and results["9stream"] else 1)
