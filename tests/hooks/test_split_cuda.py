"""A split component under the fake CUDA (tests/fakecuda.py): blocks on a second GPU, inputs every block takes copied
there once per call, every copy between the GPUs ordered."""

from __future__ import annotations

import collections

import pytest
import torch

from pipemap.dispatch import place_component as _place
from pipemap.hooks import HOOKS, Ledger, hook_component, unhook_component
from pipemap.plan import Placement


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.emb, self.norm = torch.nn.Linear(16, 16), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)

    def forward(self, x, temb):
        return self.norm(self.a(x) + self.emb(temb))


class Net(torch.nn.Module):
    def __init__(self, n: int = 6):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x, temb):
        for block in self.blocks:
            x = block(x, temb)
        return self.out(x)


@pytest.fixture
def copies(fake_cuda, monkeypatch):
    """Ops the fake saw, by name."""
    seen: collections.Counter = collections.Counter()
    real = fake_cuda.access
    monkeypatch.setattr(fake_cuda, "access", lambda stream, reads, writes, op: seen.update([op]) or real(
        stream, reads, writes, op))
    return seen


@pytest.mark.parametrize("shards", [(1, 2, 3, 4, 5), (2, 3), (1, 4)])
def test_blocks_on_a_second_gpu_get_each_call_input_once(copies, shards):
    net = Net()
    x, temb = torch.randn(2, 16), torch.randn(2, 8)
    expected = net(x, temb)
    placement = Placement("transformer", "cuda:0", 1, "split", "cuda:0", 0,
                          tuple((f"blocks.{i}", "cuda:1", 0) for i in shards))
    _place(net, placement)
    hook_component(net, HOOKS["split"](placement, "cuda:0", Ledger()))
    x, temb = x.to("cuda:0"), temb.to("cuda:0")
    net(x, temb)
    copies.clear()
    for _ in range(2):
        torch.testing.assert_close(net(x, temb).cpu(), expected)
    runs = sum(1 for i in shards if i - 1 not in shards)  # each run of consecutive blocks: x there and back
    assert copies["to_copy p2p"] == 2 * (2 * runs + 1)  # and temb once per call
    unhook_component(net)
    assert not net.__dict__.get("_hf_hook") and all("_hf_hook" not in vars(b) for b in net.blocks)
