"""Block streaming with CUDA on, under the fake CUDA (tests/fakecuda.py): the real ``CudaQueues``, pinned packed
groups and stream hook, with every copy and read checked for ordering; a broken ordering is caught."""

from __future__ import annotations

import threading

import pytest
import torch

from pipemap.hooks import HOOKS, Ledger, hook_component, stream, unhook_component
from pipemap.plan import Placement
from pipemap.runtime import streams


class Net(torch.nn.Module):
    def __init__(self, widths=(8, 32, 8, 32, 8, 32, 8)):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, widths[0]))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x))
        return x


def _streamed(net: Net, depth: int | None = None, resident: tuple[str, ...] = ()) -> Placement:
    if depth is None:  # no pieces: every top-level block, depth 1
        return Placement("transformer", "cpu", 1, "stream", "cuda:0", 10)
    paths = [f"blocks.{i}" for i in range(len(net.blocks))]
    sizes = [sum(p.numel() * 4 for p in net.blocks[i].parameters()) for i in range(len(paths))]
    return Placement("transformer", "cpu", 1, "stream", "cuda:0", 10, (), tuple(zip(paths, sizes)), resident, 0, depth)


def _hooked(net: Net, placement: Placement):
    hook = HOOKS["stream"](placement, "cuda:0", Ledger())
    hook_component(net, hook)
    assert isinstance(hook.queues, streams.CudaQueues)
    # the streamed pieces are pinned; the kept ones are copied once and never pinned (issue 26: no second copy)
    assert all(g.pinned() != (g in hook.kept) for g in hook.blocks if g.slots), [g.name for g in hook.blocks]
    return hook


def _calls(net: Net, n: int = 3) -> list[torch.Tensor]:
    """``n`` calls, then their outputs on the host: the host waits for none of them until all are queued."""
    x = torch.linspace(-1, 1, 16).reshape(2, 8).to("cuda:0")
    return [out.cpu() for out in [net(x) for _ in range(n)]]


@pytest.mark.parametrize(("depth", "resident"), [(None, ()), (1, ("blocks.1",)), (2, ("blocks.0", "blocks.3")),
                                                 (3, ("",)), (2, ("", "blocks.5"))])
def test_streamed_calls_are_ordered_and_right(fake_cuda, depth, resident):
    net = Net()
    expected = net(torch.linspace(-1, 1, 16).reshape(2, 8))
    hook = _hooked(net, _streamed(net, depth, resident))
    for out in _calls(net):
        torch.testing.assert_close(out, expected)
    assert len(hook.kept_buffers) == len(resident)
    unhook_component(net)  # the fixture checks: no race, nothing left registered


def test_kept_pieces_are_waited_for_on_the_stream_of_each_call(fake_cuda):
    # the first call on one thread's (default) stream, the next on a caller's own stream: the resident pieces it
    # finds onloaded were copied on the first stream
    net = Net()
    _hooked(net, _streamed(net, 1, ("blocks.0", "")))
    caller = torch.cuda.Stream("cuda:0")

    x = torch.ones(2, 8).to("cuda:0")
    torch.cuda.current_stream().synchronize()
    caller.wait_stream(torch.cuda.current_stream())  # x is ready on both streams; the host waits for nothing else

    def on(stream):
        with torch.cuda.stream(stream):
            net(x)

    for stream_ in (None, caller, None):
        thread = threading.Thread(target=on, args=(stream_,))
        thread.start()
        thread.join()
    unhook_component(net)


def test_one_copy_per_packed_group(fake_cuda, monkeypatch):
    net = Net()
    _hooked(net, _streamed(net))
    copies = []
    real = streams.CudaQueues.copy
    monkeypatch.setattr(streams.CudaQueues, "copy", lambda self, pairs, **kw: copies.append(len(pairs)) or real(
        self, pairs, **kw))
    _calls(net, 1)
    assert copies == [1] * (1 + len(net.blocks))  # the root's tensors, then each block: one transfer each
    unhook_component(net)


def test_an_out_of_memory_error_in_a_buffer_allocation_leaves_the_ledger_as_it_was(fake_cuda):
    net = Net()
    hook = _hooked(net, _streamed(net))
    _calls(net, 1)
    torch.cuda.empty_cache()  # the last call's buffers go back to the device ...
    fake_cuda.limit[0] = torch.cuda.memory_reserved(0)  # ... and no new segment fits: the root stays, the buffers don't
    with pytest.raises(torch.OutOfMemoryError):
        _calls(net, 1)
    assert not any(hook.ledger.live.values()) and hook.depth == 0
    fake_cuda.limit.clear()
    _calls(net, 1)
    unhook_component(net)


def test_a_copy_that_does_not_wait_for_the_buffers_last_use_is_caught(fake_cuda, monkeypatch):
    fake_cuda.expect_races = True

    def fill_without_after(self, index, buffer):
        _, buffer.copied = self._onload(self.blocks[index], buffer.tensor, after=None, side=True)
        buffer.block = index
        return buffer

    monkeypatch.setattr(stream.StreamHook, "_fill", fill_without_after)
    net = Net()
    _hooked(net, _streamed(net))
    _calls(net, 2)
    races = fake_cuda.take()
    assert races and all(r.later.op == "copy_ h2d" for r in races)  # a copy overwriting weights in use
    unhook_component(net)


def test_a_block_that_does_not_wait_for_its_copy_is_caught(fake_cuda, monkeypatch):
    fake_cuda.expect_races = True
    monkeypatch.setattr(streams.CudaQueues, "wait", lambda self, event: None)
    net = Net()
    _hooked(net, _streamed(net))
    _calls(net, 1)
    races = fake_cuda.take()
    assert races and {(r.earlier.op, r.later.kind) for r in races} == {("copy_ h2d", "read")}  # garbage weights
    unhook_component(net)
