"""A split component's blocks on one GPU pass activations on directly; only the last block of a run goes home."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipemap.dryrun import standin
from pipemap.hooks import SplitHook, hook_component, unhook_component
from pipemap.hooks.split import _run_ends


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(5))
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_run_ends():
    shards = (("blocks.1", "cuda:1", 0), ("blocks.2", "cuda:1", 0), ("blocks.3", "cuda:2", 0),
              ("blocks.4", "cuda:1", 0), ("other.5", "cuda:1", 0))
    assert _run_ends(shards) == [False, True, True, True, True]


def test_consecutive_blocks_on_one_gpu_pass_activations_directly():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    net = standin.fake_module(Net(), mode, "meta:0")
    for index in (1, 2, 3):
        net.blocks[index] = standin.fake_module(net.blocks[index], mode, "meta:1")
    arrived = []
    for index, block in enumerate(net.blocks):
        block.register_forward_hook(lambda m, a, out, index=index: arrived.append((index, str(out.device))))
    hook_component(net, SplitHook("net", "meta:0", "meta:0", tuple((f"blocks.{i}", "meta:1", 0) for i in (1, 2, 3))))
    with mode, standin.StrictDevices():
        out = net(torch.ones(2, 4, device="meta:0"))
    assert str(out.device) == "meta:0"
    assert arrived == [(0, "meta:0"), (1, "meta:1"), (2, "meta:1"), (3, "meta:0"), (4, "meta:0")]
    unhook_component(net)
