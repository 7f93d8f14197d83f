"""A dispatch on worker processes that fails after the workers started (here: a transformer with diffusers'
layerwise casting, whose hooked forward cannot be pickled) raises DispatchError and says "the pipeline was restored
as it was before dispatch", but is the worker process (which on a GPU holds a whole copy of the denoiser) stopped?

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests nice -n 10 python bench/repros/workers/failed_dispatch_leaves_no_worker.py
Prints the worker processes alive after the failed dispatch, after pipemap.reset, and after a re-plan; OK/FAIL.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PIPEMAP_WORKERS"] = "process"

import psutil  # noqa: E402
import torch  # noqa: E402

import pipemap  # noqa: E402
from helpers import with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402


def workers() -> list[int]:
    """Worker processes: spawned children, or a forkserver's (they share the server's command line; the server
    itself is this process's own child)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        line = " ".join(child.cmdline())
        forked = "forkserver" in line and child.ppid() != os.getpid()
        if ("spawn_main" in line or forked) and child.status() != psutil.STATUS_ZOMBIE:
            found.append(child.pid)
    return found


pipe = tiny.build("flux")
pipe.set_progress_bar_config(disable=True)
pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
before = workers()
try:
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    print("dispatch succeeded")
except Exception as err:  # noqa: BLE001
    print(f"dispatch raised {type(err).__name__}: {str(err)[:200]}")
time.sleep(5)
after = [p for p in workers() if p not in before]
print(f"worker processes alive 5 s after the failed dispatch: {after}")
try:
    pipemap.reset(pipe)
except Exception as err:  # noqa: BLE001
    print(f"reset raised {type(err).__name__}: {err}")
time.sleep(5)
after_reset = [p for p in after if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
print(f"... after pipemap.reset(pipe): {after_reset}")
print(f"{'OK' if not after else 'FAIL'}: a failed dispatch leaves no worker process "
      f"({len(after)} left; still {len(after_reset)} after reset)")
