"""Pinned host buffers live exactly as long as their pipeline.

A placed pipeline dropped without ``pipemap.reset`` (``del pipe``, ``pipe = pipemap.load(...)`` again in a notebook, a
service reloading its model) must leave no host memory registered (page-locked): the fake driver (tests/fakecuda.py)
answers an overlapping registration with error 712, as the real one does, so a leaked registration whose addresses
come back fails the next dispatch. Also: a dispatch that fails part-way leaves nothing registered.

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/pinned_lifetime.py
"""

from __future__ import annotations

import gc
import tempfile
import weakref

import torch

import fakecuda

fake = fakecuda.install()

from diffusers import DiffusionPipeline  # noqa: E402

import pipemap  # noqa: E402
from pipemap import tiny  # noqa: E402
from pipemap.hooks import HOOKS, Ledger, hook_component, packing  # noqa: E402
from pipemap.plan import DeviceUse, Placement, Plan  # noqa: E402

ok = True

# 1. through the public API: the tiny SD pipeline, every model offloaded to cuda:0, dropped without reset
folder = tiny.save("sd", tempfile.mkdtemp() + "/tiny-sd")
pipe = DiffusionPipeline.from_pretrained(folder)
models = [n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)]
plan = Plan("balanced_low_memory", tuple(Placement(n, "cpu", 1, "offload", "cuda:0", 10**9) for n in models),
            (DeviceUse("cuda:0", 10**10, 10**10, 0), DeviceUse("cpu", 10**10, 10**10, 0)), "cuda:0")
pipemap.dispatch(pipe, plan)
print("dispatched: registered host buffers", len(fake.registered), "bytes", sum(fake.registered.values()),
      "| pinned_bytes()", packing.pinned_bytes())
alive = weakref.ref(pipe)
del pipe
gc.collect()
print("after `del pipe` + gc, no reset: pipeline collected:", alive() is None, "| still registered",
      len(fake.registered), "buffers,", sum(fake.registered.values()), "bytes; pinned_bytes()", packing.pinned_bytes())
ok &= not fake.registered and packing.pinned_bytes() == 0


# 2. one component at a time, 20 times over: the freed addresses come back to the next pinned group
def mapped_component():
    net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    hook = HOOKS["offload"](Placement("text_encoder", "cpu", 1, "offload", "cuda:0", 10**6), "cuda:0", Ledger())
    hook_component(net, hook)
    net(torch.ones(1, 64, device="cuda:0"))
    return net, hook


attempt = 0
try:
    while attempt < 20:
        attempt += 1
        net, hook = mapped_component()
        del net, hook
        gc.collect()
    print("20 dispatches, each dropped without reset: all succeeded; registered now", len(fake.registered))
    ok &= not fake.registered
except RuntimeError as err:
    print(f"a later dispatch of the same shapes (attempt {attempt}) fails: {err}")
    ok = False

# 3. a dispatch that fails part-way (the driver refuses the third registration): nothing left registered
real = fake.cudart.cudaHostRegister
count = [0]


def third_refused(ptr, size, flags):
    count[0] += 1
    return 2 if count[0] == 3 else real(ptr, size, flags)  # cudaErrorMemoryAllocation


fake.cudart.cudaHostRegister = third_refused
pipe = DiffusionPipeline.from_pretrained(folder)
stream_plan = Plan("balanced_ultra_low_memory", tuple(Placement(n, "cpu", 1, "stream", "cuda:0", 10**9)
                                                      for n in models), plan.devices, "cuda:0")
try:
    pipemap.dispatch(pipe, stream_plan)
except pipemap.DispatchError as err:
    print("dispatch failed part-way as asked:", str(err).splitlines()[0][:100])
fake.cudart.cudaHostRegister = real
print("after the failed dispatch (the pipeline still alive): registered", len(fake.registered), "| traces left:",
      sorted(k for n in models for k in vars(getattr(pipe, n)) if k in ("_hf_hook", "_old_forward", "_apply")))
ok &= not fake.registered
fake.exit()
print("pinned memory tied to its pipeline:", ok)
raise SystemExit(0 if ok else 1)
