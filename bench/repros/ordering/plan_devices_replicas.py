"""Every GPU a plan copies between goes to the copy check, the GPUs holding denoiser replicas included, at dispatch
(``transfer.plan_devices``) and at load (``loading.check_plan_fits`` checks each exists on this machine).

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/plan_devices_replicas.py
"""

from __future__ import annotations

import pipemap
from pipemap.runtime.transfer import plan_devices

plan = pipemap.plan("stable-diffusion-xl-base-1.0", hardware="4x80GiB,cpu=64GiB", strategy="parallel")
unet = plan.placement("unet")
print("SDXL 4x80GiB parallel:", plan.device_map, "| unet mode", unet.mode, "replicas", unet.replicas)
gpus = [d for d in plan_devices(plan) if d.startswith("cuda")]
print("GPUs handed to the copy check:", gpus, "-> pairs checked:", len(gpus) * (len(gpus) - 1))
copied = sorted({unet.device, *unet.replicas})
print("GPUs the replicas copy between:", copied)
missing = sorted(set(copied) - set(gpus))
print("replica GPUs never checked:", missing or "none")
raise SystemExit(1 if missing else 0)
