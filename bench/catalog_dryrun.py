"""Every catalog pipeline dry-run at full size, at its default resolution, under "auto" on two machines.

Nothing is downloaded: models are built from the published configs on stand-in weights. For each pipeline and
machine it plans with ``strategy="auto"``, dry-runs the plan (``--steps`` denoising steps, default 1: steps repeat,
so one step's peak is every step's) and prints whether it ran, each device's peak with the phase that set it, and
the seconds the dry run took (wall and this process's CPU time: on a shared machine the CPU time is the figure to
compare with the 60 s target). The table is appended to bench/RESULTS.md.

    python bench/catalog_dryrun.py                 # all pipelines, 1x24GiB and 2x16GiB (cpu=64GiB)
    python bench/catalog_dryrun.py flux.1-dev      # one pipeline
    python bench/catalog_dryrun.py flux.1-dev qwen-image wan2.1-t2v-14b --machines 2x80GiB,cpu=128GiB --steps 2
                                                   # two GPUs: split tokens, guidance branches (from step 2)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import pipemap
from pipemap import catalog
from pipemap.units import format_bytes

MACHINES = ("1x24GiB,cpu=64GiB", "2x16GiB,cpu=64GiB")
# a pipeline's default call where the dry run's own differs from the model card's: Qwen-Image's true CFG needs a
# negative prompt (the cost model's default call, cost.PIPELINE_DEFAULTS, has it)
CALLS = {"qwen-image": {"negative_prompt": " ", "true_cfg_scale": 4.0}}
RESULTS = Path(__file__).parent / "RESULTS.md"


def one(name: str, machine: str, steps: int) -> str:
    start = time.perf_counter()
    plan = pipemap.plan(name, hardware=machine, strategy="auto")
    planned = time.perf_counter() - start
    wall, cpu = time.perf_counter(), time.process_time()
    report = pipemap.simulate(name, plan, steps=steps, **CALLS.get(name, {}))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    # the note naming the chosen strategy ("auto: X is the fastest plan that fits"), not the pricing note before it
    strategy = next((n.split(":")[1].split(" is ")[0].strip() for n in plan.notes
                     if n.startswith("auto:") and " is the fastest plan" in n), "auto")
    peaks = "; ".join(f"{d} {format_bytes(p)} ({report.peak_phase.get(d, '?')})"
                      for d, p in report.peak_bytes.items() if d != "cpu")
    verdict = report.verdict if report.ok else f"FAILED: {report.error}"  # "DOES NOT FIT": a peak above its memory
    advice = (" " + " ".join(report.advice)) if report.advice else ""
    return (f"| {name} | {machine.split(',')[0]} | {strategy} | {verdict}{advice} | {peaks} | {planned:.1f} | "
            f"{wall:.1f} | {cpu:.1f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="catalog names (default: all)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--machines", nargs="+", default=MACHINES, help="hardware specs (default: %(default)s)")
    args = parser.parse_args(argv)
    lines = ["| pipeline | hardware | auto chose | dry run | peak per GPU (phase) | plan s | dry run s (wall) | "
             "dry run s (CPU) |", "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    for name in args.names or catalog.names():
        for machine in args.machines:
            lines.append(one(name, machine, args.steps))
            print(lines[-1], flush=True)
    if not args.no_record:
        record(lines, args)


def record(lines: list[str], args: argparse.Namespace) -> None:
    import torch

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machines = "" if tuple(args.machines) == MACHINES else " --machines " + " ".join(args.machines)
    head = [f"## {stamp} — `bench/catalog_dryrun.py{' ' + ' '.join(args.names) if args.names else ''} "
            f"--steps {args.steps}{machines}`", "",
            f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.1f} at the end (a shared machine: wall seconds stretch, CPU seconds hold)",
            f"- torch {torch.__version__}; default resolution of each pipeline; {args.steps} denoising step(s); "
            f"machines {', '.join(args.machines)}; {CALLS} beside the dry run's default call", ""]
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write("\n" + "\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
