"""Denoiser replicas run their part of the batch on a thread of their own: that thread must run under the caller's
per-thread state. 1: autocast (shown on the CPU); 2: a caller-chosen CUDA stream, under the fake CUDA
(tests/fakecuda.py): the copies into and out of the replica must be ordered after the caller's work on its stream;
3: calls whose home part raised must not stay pending.

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/replica_threads.py
"""

from __future__ import annotations

import torch

import fakecuda
from pipemap.dispatch import place_module
from pipemap.hooks import ReplicaHook, hook_component, unhook_component

torch.manual_seed(0)
ok = True


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.fail = False

    def forward(self, x):
        if self.fail and x.shape[0] == 1:  # the home part (the first half of the batch) fails
            raise torch.OutOfMemoryError("CUDA out of memory on the home GPU (simulated)")
        return self.b(torch.nn.functional.gelu(self.a(x)))


# 1. autocast
plain = Denoiser()
x = torch.randn(2, 64)
with torch.autocast("cpu", dtype=torch.bfloat16):
    expected = plain(x)
replicated = Denoiser()
replicated.load_state_dict(plain.state_dict())
hook = ReplicaHook("unet", "cpu", "cpu", ("cpu",))  # a copy on a second "device": its half runs on a pool thread
hook_component(replicated, hook)
with torch.autocast("cpu", dtype=torch.bfloat16):
    got = replicated(x)
print("caller's autocast: whole batch dtype", expected.dtype, "| replicated output dtype", got.dtype)
for i, name in enumerate(("home half (caller's thread)", "replica half (pool thread)")):
    diff = float((got[i].detach().float() - expected[i].detach().float()).abs().max())
    print(f"  {name}: max |diff| from the autocast run {diff:.3g}")
    ok &= diff == 0.0
ok &= got.dtype == expected.dtype

# 3. failed calls
replicated.fail = True
for _ in range(3):
    try:
        replicated(torch.randn(2, 64))
    except torch.OutOfMemoryError:
        pass
print("after 3 calls whose home part raised: pending calls", len(hook._pending))
ok &= not hook._pending
unhook_component(replicated)

# 2. a caller-chosen stream, on two fake GPUs
fake = fakecuda.install()
net = Denoiser()
place_module(net, "cuda:0")
hook_component(net, ReplicaHook("unet", "cuda:0", "cuda:0", ("cuda:1",)))
caller = torch.cuda.Stream("cuda:0")
with torch.cuda.stream(caller):
    latents = torch.randn(2, 64).to("cuda:0") * 2  # the caller's work on its stream
    out = net(latents)
    after = out + 1  # and what it does next with the joined output
print("caller-chosen stream:", fake.report())
ok &= not fake.races
unhook_component(net)
fake.exit()
print("replica threads share the caller's state:", ok)
raise SystemExit(0 if ok else 1)
