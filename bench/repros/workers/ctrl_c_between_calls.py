"""Ctrl-C in a terminal sends SIGINT to every process of the foreground process group: the spawned workers are in
the caller's group. What does one SIGINT between calls (the user interrupting, then going on) do to the workers?

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests nice -n 10 python bench/repros/workers/ctrl_c_between_calls.py
Prints the workers' process group, whether a worker survives a SIGINT, and what the next call costs; OK/FAIL.
"""

from __future__ import annotations

import os
import signal
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PIPEMAP_WORKERS"] = "process"

import psutil  # noqa: E402
import torch  # noqa: E402

import pipemap  # noqa: E402
from helpers import with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402

pipe = tiny.build("flux")
pipe.set_progress_bar_config(disable=True)
call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=3, negative_prompt="blurry",
            true_cfg_scale=2.0)
pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
hook = pipe.transformer._hf_hook
pipe(**call)
(pid,) = hook.pids()
print(f"caller pgid {os.getpgid(0)}, worker {pid} pgid {os.getpgid(pid)} (same group: Ctrl-C reaches it)")
os.kill(pid, signal.SIGINT)  # what the terminal does to each process of the group on Ctrl-C
time.sleep(3)
alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
t0 = time.monotonic()
pipe(**call)
took = time.monotonic() - t0
print(f"worker alive after one SIGINT: {alive}; next call {took:.1f}s, workers now {hook.pids()}, "
      f"hits {hook.hits} misses {hook.misses}")
print(f"{'OK' if alive else 'FAIL'}: a Ctrl-C between calls leaves the workers running")
pipemap.reset(pipe)
