"""``pipemap serve --ray`` asks Ray for every GPU the plan computes on, the GPUs of denoiser replicas included; with
fewer, the replica process would see fewer GPUs and ``api.runnable`` (what ``Service.load`` runs) would remap the
missing copy onto the CPU.

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/serve_replica_gpus.py
"""

from __future__ import annotations

import pipemap
import pipemap.api as api
from pipemap.hardware import Device, Hardware
from pipemap.serve.deployment import gpus

plan = pipemap.plan("stable-diffusion-xl-base-1.0", hardware="4x80GiB,cpu=64GiB", strategy="parallel")
unet = plan.placement("unet")
computes_on = sorted({unet.device, *unet.replicas, *(p.device for p in plan.components)})
print("plan:", plan.device_map, "| unet", unet.mode, "copies on", unet.replicas)
print("GPUs the plan computes on:", computes_on, "| num_gpus Ray is asked for:", gpus(plan))
visible = gpus(plan)  # Ray sets CUDA_VISIBLE_DEVICES to that many GPUs
seen = Hardware(tuple(Device(f"cuda:{i}", 80 * 2**30) for i in range(visible)) + (Device("cpu", 64 * 2**30),))
api.Hardware = type("H", (), {"detect": staticmethod(lambda: seen)})
running = api.runnable(plan)
print("runnable(plan) in that replica: unet copies on", running.placement("unet").replicas)
raise SystemExit(0 if gpus(plan) == len(computes_on) and "cpu" not in running.placement("unet").replicas else 1)
