"""(a) Each parallel mode with its other ranks as worker processes (PIPEMAP_WORKERS=process, gloo on the CPU) against
plain diffusers: a plan for 2 GPUs (guidance_sequence: 4) remapped onto the CPU, max |workers - plain| <= 1e-4, and a
second process computed (the hook's ``served`` pids are not this process's). After reset no worker is left.

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests nice -n 10 python bench/repros/workers/every_mode_equals_plain.py [case ...]
Cases: flux-sequence flux-replicated flux-cfg-guidance qwen-guidance wan-guidance wan-sequence
       wan-guidance_sequence sdxl-replicated sd-replicated flux-cfg-guidance_sequence   (default: all)
Prints one OK/FAIL line per case.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PIPEMAP_WORKERS"] = "process"
os.environ.setdefault("PIPEMAP_WORKER_TIMEOUT", "120")

import torch  # noqa: E402

import families  # noqa: E402  (tests/)
import pipemap  # noqa: E402
from families import fresh, output  # noqa: E402
from helpers import processes_gone, with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402

STEPS = 3


def tiny_case(kind: str, **extra):
    pipe = tiny.build(kind)
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, kind, output_type="pt"), num_inference_steps=STEPS, **extra)
    return pipe, call


def build(case: str):
    family, mode = case.rsplit("-", 1)
    if family == "flux":
        pipe, call = tiny_case("flux", **({"num_images_per_prompt": 2} if mode == "replicated" else {}))
    elif family == "flux-cfg":
        pipe, call = tiny_case("flux", negative_prompt="blurry", true_cfg_scale=2.0)
    elif family in ("sdxl", "sd"):
        pipe, call = tiny_case(family)
    elif family == "qwen":
        pipe, call = families.true_cfg("qwen_image", STEPS)
    elif family == "wan":
        pipe, call = families.build("wan_t2v")
        call = dict(call, num_inference_steps=STEPS)
    else:
        raise SystemExit(f"unknown case {case}")
    component = "unet" if family in ("sd", "sdxl") else "transformer"
    return pipe, call, component, mode


def run(case: str) -> bool:
    pipe, call, component, mode = build(case)
    plain = output(pipe(**fresh(call)))
    copies = 3 if mode == "guidance_sequence" else 1
    gpus = 1 + copies
    plan = with_copy(pipe, mode, component=component, hardware=f"{gpus}x64MiB,cpu=1GiB", copies=copies)
    t0 = time.monotonic()
    pipemap.dispatch(pipe, plan.remap({f"cuda:{i}": "cpu" for i in range(gpus)}))
    up = time.monotonic() - t0
    hook = getattr(pipe, component)._hf_hook
    pids = hook.pids()
    t0 = time.monotonic()
    got = output(pipe(**fresh(call)))
    wall = time.monotonic() - t0
    diff = (got.float() - plain.float()).abs().max().item()
    served = list(getattr(hook.ranks, "served", []))
    others = sorted(set(served) - {os.getpid()})
    stats = {k: getattr(hook, k) for k in ("hits", "misses", "whole") if hasattr(hook, k)}
    pipemap.reset(pipe)
    gone = processes_gone(pids)
    ok = diff <= 1e-4 and bool(others) and gone
    print(f"{'OK' if ok else 'FAIL'}: {case}: {type(hook).__name__} workers={pids} max|workers - plain|={diff:.2e} "
          f"outputs from worker pids={others} ({len(served)} received) {stats} dispatch {up:.1f}s call {wall:.1f}s "
          f"workers gone after reset: {gone}", flush=True)
    return ok


CASES = ("flux-sequence", "flux-replicated", "flux-cfg-guidance", "qwen-guidance", "wan-guidance", "wan-sequence",
         "wan-guidance_sequence", "sdxl-replicated", "sd-replicated", "flux-cfg-guidance_sequence")

if __name__ == "__main__":
    results = []
    for case in sys.argv[1:] or CASES:
        try:
            results.append(run(case))
        except Exception as err:  # noqa: BLE001
            print(f"FAIL: {case}: {type(err).__name__}: {str(err).splitlines()[0][:300]}", flush=True)
            results.append(False)
    print(f"{sum(results)}/{len(results)} cases OK")
