"""``pipemap serve`` against direct ``run_many``: a burst of requests, on CPU, in the same run.

    python bench/serve.py                 # a burst of 16 requests, 3 rounds, tiny SD 32x32 (a minute or two)
    python bench/serve.py --burst 32 --steps 4 --workers 2 --no-record
    python bench/serve.py --clients 1,4,16,64 --seconds 20 --no-record   # load: closed-loop clients at each level
    python bench/serve.py --clients 1,4,16,64 --max-batch 8 --no-record  # the same, batching on
    python bench/serve.py --head-of-line 40 --no-record   # a 40-step request, then a short one: when each is answered

With ``--clients``: at each level, that many client threads each send a request, wait for its answer and send the
next, for ``--seconds``; a 429 is counted and retried after its Retry-After (as OpenAI's client does).
Figures per level: images per second answered 200, latency p50/p99 of the 200s, 429s, and the process's RSS after
the level (the server runs in this process).

Each round sends the burst to the server at once (one client thread per request, over loopback HTTP) and then
hands the same calls to ``pipemap.iter_many`` on the same pipeline; rounds alternate so load on a shared machine
falls on both. Latency is from the burst's start to each answer (the server's includes PNG encoding, base64 and
HTTP; the direct run's stops at the pipeline's images). Figures are medians over rounds; ratios are server / direct.
The table is printed and appended to ``bench/RESULTS.md``; the last line is ``summary: name=value ...``.
"""

from __future__ import annotations

import argparse
import contextlib
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
        service = Service.load(Options(str(folder), hardware="cpu=64GiB", max_queue=args.max_queue or args.burst,
                                       timeout=600.0, max_n=1, workers=args.workers, max_batch=args.max_batch,
                                       batch_window=args.batch_window_ms / 1000))
        if args.clients:
            _load(args, service)
            return
        if args.head_of_line:
            _head_of_line(args, service)
            return
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
    parser.add_argument("--head-of-line", type=int, metavar="STEPS", help="send a request of STEPS steps, then one "
                        "of --steps: seconds to each answer (the short one should not wait for the long one)")
    parser.add_argument("--clients", help="load levels, e.g. 1,4,16,64: closed-loop clients at each")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per load level (default 20)")
    parser.add_argument("--max-queue", type=int, help="the server's queue (default: --burst)")
    parser.add_argument("--max-batch", type=int, default=1, help="the server's --max-batch (default 1: off)")
    parser.add_argument("--batch-window-ms", type=float, default=20.0, help="the server's batch window (default 20)")
    return parser.parse_args()


def _load(args, service) -> None:
    """Closed-loop clients at each level of ``--clients``: one table row per level; with ``--max-batch`` N > 1, the
    same level run with batching off and then on (two services on the one pipeline, paired so the machine's load
    falls on both), and the ratio."""
    levels = [int(level) for level in args.clients.split(",")]
    ways = {"off": service}
    if args.max_batch > 1:
        ways = {"off": Service(service.pipe, service.plan, service.running_plan, max_queue=service.worker.max_queue,
                               timeout=600.0, max_n=1, workers=args.workers, sizes=service.sizes), "on": service}
    lines = [f"## serve load {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
             f"cores, torch {torch.__version__}, {_revision()}\n",
             f"tiny SD scale {args.scale}, {args.size}x{args.size}, {args.steps} steps, {args.workers} workers, "
             f"queue {service.worker.max_queue}, batch {args.max_batch} (window {args.batch_window_ms:g} ms), "
             f"{args.seconds:g} s a level and way; 429s retried after their Retry-After\n",
             "| clients | batching | images / s | p50 (s) | p99 (s) | 200s | 429s | other | RSS (MiB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    summary = {}
    with contextlib.ExitStack() as stack:
        urls = {way: stack.enter_context(Background(each)) for way, each in ways.items()}
        for url in urls.values():  # warm: each shape measured, lazy inits paid
            _level(args, url, max(levels), seconds=5.0)
        for level in levels:
            for way, url in urls.items():
                figures = _level(args, url, level)
                summary[f"c{level}_{way}_ips"] = figures[0]
                lines.append(f"| {level} | {way} | " + " | ".join(f"{f:.3g}" for f in figures) + " |")
                print(lines[-1], flush=True)
    if "on" in ways:
        summary.update({f"c{level}_ratio": summary[f"c{level}_on_ips"] / summary[f"c{level}_off_ips"]
                        for level in levels})
    table = "\n".join(lines) + "\n\n```\nsummary: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()) + "\n```"
    print(table)
    if not args.no_record:
        with RESULTS.open("a") as results:
            results.write(f"\n{table}\n")


def _head_of_line(args, service) -> None:
    """A long request, then a short one 0.2 s later, three times: seconds from each one's sending to its answer."""
    long_call, short_call = ({"prompt": "a tiny cat", "seed": 1, "size": f"{args.size}x{args.size}",
                              "num_inference_steps": steps} for steps in (args.head_of_line, args.steps))
    rows = []
    with Background(service) as url, httpx.Client(base_url=url, timeout=600) as client:
        client.post("/v1/images/generations", json=short_call).raise_for_status()  # the shape measured, inits paid

        def timed(body) -> float:
            start = time.perf_counter()
            client.post("/v1/images/generations", json=body).raise_for_status()
            return time.perf_counter() - start

        for _ in range(3):
            with ThreadPoolExecutor(2) as pool:
                slow = pool.submit(timed, long_call)
                time.sleep(0.2)
                fast = pool.submit(timed, short_call)
                rows.append((slow.result(), fast.result()))
    print(f"head of line, {args.workers} workers: {args.head_of_line}-step request then {args.steps}-step one, "
          "seconds to each answer:")
    for long_s, short_s in rows:
        print(f"  long {long_s:.2f} s, short {short_s:.2f} s (short / long {short_s / long_s:.2f})")
    print("summary: " + f"long_s={statistics.median(r[0] for r in rows):.3g} "
          f"short_s={statistics.median(r[1] for r in rows):.3g}")


def _level(args, url: str, clients: int, seconds: float | None = None) -> tuple[float, ...]:
    """Images per second, p50 and p99 latency, 200s, 429s, other codes, RSS in MiB."""
    end = time.perf_counter() + (seconds or args.seconds)
    latencies: list[float] = []
    codes: dict[int, int] = {}

    def client(index: int) -> None:
        body = _calls(args)[index % args.burst]
        with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1)) as session:
            while time.perf_counter() < end:
                start = time.perf_counter()
                response = session.post("/v1/images/generations", json=body)
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                if response.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                elif response.status_code == 429:
                    time.sleep(min(float(response.headers["retry-after"]), max(0.0, end - time.perf_counter())))

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    elapsed = time.perf_counter() - started
    ok = codes.get(200, 0)
    other = sum(n for code, n in codes.items() if code not in (200, 429))
    p50, p99 = (_percentile(latencies, 50), _percentile(latencies, 99)) if latencies else (float("nan"),) * 2
    return ok / elapsed, p50, p99, ok, codes.get(429, 0), other, _rss() / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
