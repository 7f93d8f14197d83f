"""The thread guidance hook with diffusers' layerwise casting, on a plan for two GPUs remapped onto the CPU: the copy
shares the home model's weights there, and layerwise casting re-casts them in place around each call while the copy
runs, so a call sometimes fails ("self and mat2 must have the same dtype ... Float and Float8_e4m3fn"). On real GPUs
the copy holds its own weights. Found while testing issue 48's fall-back to threads.

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests python bench/repros/workers/thread_guidance_layerwise_race.py
Prints one line per attempt: ok (with the largest difference from plain) or fail.
"""

from __future__ import annotations

import torch

import pipemap
from families import fresh, output
from helpers import with_copy
from pipemap import tiny

for attempt in range(5):
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), negative_prompt="blurry", true_cfg_scale=2.0)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap({"cuda:0": "cpu", "cuda:1": "cpu"}), ranks="thread")
    try:
        out = output(pipe(**fresh(call)))
        print(f"attempt {attempt}: ok, max|placed - plain| {float((out - plain).abs().max()):.2e}")
    except Exception as err:  # noqa: BLE001
        print(f"attempt {attempt}: fail, {type(err).__name__}: {str(err)[:100]}")
    pipemap.reset(pipe)
