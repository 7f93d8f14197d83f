"""How long a split's worker process takes to start (``Workers.sync`` of a small module: start, hello, load, the
group's self-test), by start method (``PIPEMAP_WORKER_START``): a forkserver's first start pays its preload of torch,
diffusers and pipemap, its later ones only a fork; each spawned start imports them again.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/worker_start.py [--starts 3] [--append bench/RESULTS.md]

Wall seconds per start: on a shared machine, compare the methods within one run."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import time

import torch

from pipemap.hooks.launch import START_ENV
from pipemap.hooks.worker import Source
from pipemap.hooks.workers import Workers


def starts(method: str, count: int) -> list[float]:
    """Seconds of each of ``count`` starts of one worker with ``method``, in this process."""
    os.environ[START_ENV] = method
    cpu, module = torch.device("cpu"), torch.nn.Linear(3, 2)
    taken = []
    for _ in range(count):
        workers = Workers("m", cpu, (cpu,))
        began = time.monotonic()
        try:
            workers.sync(module, Source.of(module))
            taken.append(time.monotonic() - began)
        finally:
            workers.close()
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--append", help="a results file to append the table to")
    args = parser.parse_args()
    rows = {method: starts(method, args.starts) for method in ("forkserver", "spawn")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## worker start {now}, {os.cpu_count()} cores, torch {torch.__version__}, {commit}", "",
             f"`bench/worker_start.py`: one worker on the CPU, {args.starts} starts in one process, wall seconds "
             f"(load average {os.getloadavg()[0]:.1f})", "", "| method | " +
             " | ".join(f"start {i + 1}" for i in range(args.starts)) + " |",
             "| --- |" + " ---: |" * args.starts]
    lines += [f"| {method} | " + " | ".join(f"{s:.2f}" for s in taken) + " |" for method, taken in rows.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(args.append, "a") as out:
            out.write("\n" + text)


if __name__ == "__main__":
    main()
