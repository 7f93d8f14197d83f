"""How many copies a call queues, counted by the fake CUDA (tests/fakecuda.py): a streamed block's weights in one
transfer per packed group (not one per tensor), and a split component's small per-block inputs (a timestep
embedding) copied to its second GPU once per call, not at every block.

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/copies_per_block.py
"""

from __future__ import annotations

import collections

import torch

import fakecuda

fake = fakecuda.install()

from pipemap.dispatch import place_component  # noqa: E402
from pipemap.hooks import HOOKS, Ledger, hook_component  # noqa: E402
from pipemap.plan import Placement  # noqa: E402

ops: collections.Counter = collections.Counter()
real_access = fake.access


def counting(stream, reads, writes, op):
    ops[op] += 1
    return real_access(stream, reads, writes, op)


fake.access = counting


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)
        self.emb = torch.nn.Linear(8, 16)

    def forward(self, x, temb):
        return self.norm(self.b(self.a(x)) + self.emb(temb))


class Net(torch.nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x, temb):
        for block in self.blocks:
            x = block(x, temb)
        return x


# 1. streaming: 6 blocks of 8 tensors each
net = Net()
hook = HOOKS["stream"](Placement("unet", "cpu", 1, "stream", "cuda:0", 10), "cuda:0", Ledger())
hook_component(net, hook)
x, temb = torch.ones(2, 16, device="cuda:0"), torch.ones(2, 8, device="cuda:0")
net(x, temb)
ops.clear()
net(x, temb)
tensors = sum(len(g.slots) for g in hook.blocks)
print(f"stream: one call copies {ops['copy_ h2d']} times host to GPU for {len(hook.blocks)} blocks of {tensors} "
      "tensors in all")
ok = ops["copy_ h2d"] <= len(hook.blocks) + 1  # one per block, and one for the root's tensors

# 2. split: blocks 1..5 on cuda:1, the root on cuda:0; temb is an input of every block
split = Net()
placement = Placement("unet", "cuda:0", 1, "split", "cuda:0", 0,
                      tuple((f"blocks.{i}", "cuda:1", 0) for i in range(1, 6)))
place_component(split, placement)
hook_component(split, HOOKS["split"](placement, "cuda:0", Ledger()))
split(x, temb)
ops.clear()
split(x, temb)
print(f"split: one call copies {ops['to_copy p2p']} times between the GPUs (x in and out, temb to cuda:1)")
ok &= ops["to_copy p2p"] <= 3
fake.exit()
raise SystemExit(0 if ok else 1)
