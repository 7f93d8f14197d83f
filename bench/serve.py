"""``pipemap serve`` against direct ``run_many``: a burst of requests, on CPU, in the same run.

    python bench/serve.py                 # a burst of 16 requests, 3 rounds, tiny SD 32x32 (a minute or two)
    python bench/serve.py --burst 32 --steps 4 --workers 2 --no-record

Each round sends the burst to the server at once (one client thread per request, over loopback HTTP) and then
hands the same calls to ``pipemap.iter_many`` on the same pipeline; rounds alternate so load on a shared machine
falls on both. Latency is from the burst's start to each answer (the server's includes PNG encoding, base64 and
HTTP; the direct run's stops at the pipeline's images). Figures are medians over rounds; ratios are server / direct.
The table is printed and appended to ``bench/RESULTS.md``; the last line is ``summary: name=value ...``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import torch  # noqa: E402

import pipemap  # noqa: E402
from pipemap import tiny  # noqa: E402
from pipemap.quiet import quiet_progress  # noqa: E402
from pipemap.serve import Background, Options, Service  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def main() -> None:
    args = _arguments()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pipemap-bench-serve-") as root:
        with quiet_progress():
            folder = tiny.save("sd", Path(root) / "sd", variant_fp16=False, scale=args.scale)
        service = Service.load(Options(str(folder), hardware="cpu=64GiB", max_queue=args.burst,
                                       timeout=600.0, max_n=1, workers=args.workers))
        with Background(service) as url, httpx.Client(base_url=url, timeout=600) as client:
            rounds = _rounds(args, client, service.pipe)
    rows = _rows(args, rounds)
    table = _table(args, rows)
    print(table)
    summary = "summary: " + " ".join(f"{key}={value:.3g}" for key, value in rows.items())
    print(summary)
    if not args.no_record:
        with RESULTS.open("a") as results:
            results.write(f"\n{table}\n```\n{summary}\n```\n")


def _arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=16, help="requests sent at once (default 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--scale", type=int, default=1, help="tiny pipeline channel scale (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="requests in flight, both ways (default 2)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to bench/RESULTS.md")
    return parser.parse_args()


def _calls(args) -> list[dict]:
    return [{"prompt": f"a tiny cat, take {i}", "seed": i, "size": f"{args.size}x{args.size}",
             "num_inference_steps": args.steps} for i in range(args.burst)]


def _rounds(args, client, pipe) -> list[dict]:
    _served(client, _calls(args)[:1])  # warm both paths: first calls pay for lazy inits
    _direct(pipe, _calls(args)[:1], args.workers)
    rounds = []
    for _ in range(args.rounds):
        served = _served(client, _calls(args))
        direct = _direct(pipe, _calls(args), args.workers)
        rounds.append({"served": served, "direct": direct})
    return rounds


def _served(client, calls: list[dict]) -> list[float]:
    """Seconds from the burst's start to each answer, every request sent at once."""
    start = time.perf_counter()

    def one(body):
        response = client.post("/v1/images/generations", json=body)
        response.raise_for_status()
        return time.perf_counter() - start

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def _direct(pipe, calls: list[dict], workers: int) -> list[float]:
    """The same calls through ``iter_many``: seconds from the start to each result."""
    kwargs = [{"prompt": c["prompt"], "width": int(c["size"].split("x")[0]), "height": int(c["size"].split("x")[1]),
               "num_inference_steps": c["num_inference_steps"], "output_type": "pil",
               "generator": torch.Generator("cpu").manual_seed(c["seed"])} for c in calls]
    start = time.perf_counter()
    return [time.perf_counter() - start for _ in pipemap.iter_many(pipe, kwargs, workers=workers)]


def _rows(args, rounds: list[dict]) -> dict[str, float]:
    out = {}
    for way in ("served", "direct"):
        out[f"{way}_rps"] = statistics.median(args.burst / max(r[way]) for r in rounds)
        for q in (50, 90, 99):
            out[f"{way}_p{q}_s"] = statistics.median(_percentile(r[way], q) for r in rounds)
    out["rps_ratio"] = out["served_rps"] / out["direct_rps"]
    out["p50_ratio"] = out["served_p50_s"] / out["direct_p50_s"]
    return out


def _percentile(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _table(args, rows: dict[str, float]) -> str:
    head = (f"## serve {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{_revision()}\n\nburst of {args.burst} requests, tiny SD scale {args.scale}, {args.size}x{args.size}, "
            f"{args.steps} steps, {args.workers} workers, median of {args.rounds} rounds\n")
    lines = ["| figure | served (HTTP) | direct run_many | served / direct |", "| --- | --- | --- | --- |",
             f"| requests / s | {rows['served_rps']:.3g} | {rows['direct_rps']:.3g} | {rows['rps_ratio']:.3f} |"]
    for q in (50, 90, 99):
        served, direct = rows[f"served_p{q}_s"], rows[f"direct_p{q}_s"]
        lines.append(f"| latency p{q} (s) | {served:.3g} | {direct:.3g} | {served / direct:.3f} |")
    return head + "\n" + "\n".join(lines)


def _revision() -> str:
    here = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no git"


if __name__ == "__main__":
    sys.exit(main())
