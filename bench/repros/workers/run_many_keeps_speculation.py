"""Guidance branches under ``pipemap.run_many`` (requests overlapped on twins of the pipeline): the thread path keeps
each thread's call started ahead apart; on a worker process, ``Workers.send`` first receives any earlier call still
out on that rank, so one request's send can take the other request's call started ahead. Hits and misses of each.

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests nice -n 10 python bench/repros/workers/run_many_keeps_speculation.py
Prints hits/misses and equality with plain for threads and for a worker process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import pipemap  # noqa: E402
from helpers import with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402

STEPS = 6
REQUESTS = 4


def build():
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=STEPS,
                negative_prompt="blurry", true_cfg_scale=2.0)
    call.pop("generator", None)
    return pipe, call


def calls(call):
    return [dict(call, generator=torch.Generator().manual_seed(i)) for i in range(REQUESTS)]


for workers in ("thread", "process"):
    os.environ["PIPEMAP_WORKERS"] = workers
    pipe, call = build()
    plain = [torch.as_tensor(pipe(**c).images) for c in calls(call)]
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    hook = pipe.transformer._hf_hook
    outs = pipemap.run_many(pipe, calls(call), workers=2)
    diff = max((torch.as_tensor(o.images) - p).abs().max().item() for o, p in zip(outs, plain))
    possible = REQUESTS * (STEPS - 1)
    print(f"{workers}: run_many {REQUESTS} requests x {STEPS} steps, 2 at a time: hits {hook.hits} misses "
          f"{hook.misses} (of {possible} steps that could hit), max|run_many - plain| {diff:.2e}", flush=True)
    pipemap.reset(pipe)
