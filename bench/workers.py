"""Host time of strategy "parallel"'s replicated denoiser (batch halves) with its second rank a worker process
(``PIPEMAP_WORKERS=process``, ``hooks/workers.py``) against the same plan with the rank a thread of the caller's
process (``ranks="thread"``) and against the plain pipeline, on the CPU: a plan for two GPUs remapped onto the CPU
(``cuda:0`` and ``cuda:1`` both ``cpu``); the replicated unet of the tiny SD pipeline and of a mid-size one (channels
x ``--scale``), the tiny Flux's transformer split by tokens, and its guidance branches (true CFG), built in code.
Per pipeline call, medians: wall time, the caller's process CPU time (rank 0: with threads it includes the other
rank's compute, with processes only its own share), and the CPU time of all ranks (caller and workers).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/workers.py [--repeats 7] [--scale 8] [--steps 4]
    python bench/workers.py --device cuda --out DIR     # on a GPU machine: the planned GPUs onto its GPUs

Prints a table and appends it to bench/RESULTS.md (with ``--out``, writes it there as workers.md instead). On the
CPU the ranks also compute on the host, so these figures are host time including compute. With ``--device cuda``
the plan's cuda:0 and cuda:1 go to the machine's first two GPUs; where it has one, both go onto it (the one-GPU
control: the copies share its compute, and the worker joins rank 0 over gloo through host memory, as NCCL takes
one rank per GPU). The pipelines here are small enough that a call on a GPU is bound by its host: its wall time and
each rank's CPU time are the per-rank host time the issue asks for (the CPU time also counts CUDA's spin-waits).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import psutil
import torch

import pipemap
from pipemap import tiny

HERE = Path(__file__).resolve().parent


def onto(device: str, gpus: int = 2) -> dict[str, str]:
    """Where the plan's GPUs go: the CPU, or this machine's GPUs (several onto one where it has fewer)."""
    if device == "cpu":
        return {f"cuda:{i}": "cpu" for i in range(gpus)}
    have = max(1, torch.cuda.device_count())
    return {f"cuda:{i}": f"cuda:{i % have}" for i in range(gpus)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cpu(workers: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in workers)


def timed(pipe, call: dict, repeats: int, component: str) -> tuple[float, float, float]:
    """Median wall seconds of one pipeline call, CPU seconds of the caller's process, and CPU seconds of all ranks
    (the caller and its worker processes); a first, warm-up call not counted."""
    pipe(**dict(call, generator=torch.Generator().manual_seed(0)))
    hook = getattr(getattr(pipe, component), "_hf_hook", None)
    workers = [psutil.Process(pid) for pid in getattr(hook, "pids", list)()]
    walls, cpus, alls = [], [], []
    for _ in range(repeats):
        _sync()
        wall, cpu, every = time.perf_counter(), time.process_time(), _cpu(workers)
        pipe(**dict(call, generator=torch.Generator().manual_seed(0)))
        _sync()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        alls.append(cpus[-1] + _cpu(workers) - every)
    return statistics.median(walls), statistics.median(cpus), statistics.median(alls)


def with_copy(pipe, mode: str, component: str, copies: int = 1) -> pipemap.Plan:
    """Every component on cuda:0, ``component`` with a copy on each of cuda:1.. in ``mode`` (as tests/helpers.py
    does)."""
    models = [n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)]
    plan = pipemap.plan(pipe, hardware=f"{1 + copies}x4GiB,cpu=16GiB", strategy=dict.fromkeys(models, "cuda:0"),
                        headroom=0.0)
    size, gpus = plan.placement(component).bytes, tuple(f"cuda:{i}" for i in range(1, 1 + copies))
    parts = tuple(dataclasses.replace(p, mode=mode, replicas=gpus) if p.component == component else p
                  for p in plan.components)
    devices = tuple(dataclasses.replace(d, used=d.used + size) if d.device in gpus else d for d in plan.devices)
    return dataclasses.replace(plan, strategy="parallel", components=parts, devices=devices)


def case(kind: str, scale: int, steps: int):
    """The pipeline, its call and the component split."""
    pipe = tiny.build("flux" if kind != "sd" else "sd", scale=scale)
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux" if kind != "sd" else "sd"), num_inference_steps=steps)
    if kind == "sd":
        return pipe, call, "unet"
    if kind == "flux-true-cfg":  # two transformer calls a step: guidance branches
        return pipe, dict(call, negative_prompt="blurry", true_cfg_scale=2.0), "transformer"
    return pipe, call, "transformer"


COPIES = {"guidance_sequence": 3}  # a plan for four GPUs: each guidance branch split over two; the rest two


RANKS = ("plain", "thread", "process")  # with --ray also "ray": the worker process as a Ray actor


def measure(kind: str, scale: int, steps: int, repeats: int, device: str = "cpu", ranks_of: tuple[str, ...] = RANKS,
            mode: str = "sequence") -> dict[str, tuple[float, float, float] | str]:
    """Per way of running the other ranks (none: plain), its figures (``timed``), or the error that stopped it."""
    found: dict[str, tuple[float, float, float] | str] = {}
    copies = COPIES.get(mode, 1)
    for ranks in ranks_of:
        pipe, call, component = case(kind, scale, steps)
        try:
            if ranks == "plain":
                pipe.to(onto(device)["cuda:0"])
            else:
                os.environ["PIPEMAP_WORKERS"] = ranks
                pipemap.dispatch(pipe, with_copy(pipe, mode, component, copies).remap(onto(device, 1 + copies)))
            found[ranks] = timed(pipe, call, repeats, component)
        except Exception as err:  # a row that says why, the others still measured
            found[ranks] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        finally:
            if ranks != "plain":
                pipemap.reset(pipe)
    os.environ.pop("PIPEMAP_WORKERS", None)
    return found


def transformer_inputs(pipe, call: dict) -> tuple[tuple, dict]:
    """The inputs of the transformer's first call in a pipeline call of one step."""
    captured: dict = {}

    def grab(module, args, kwargs):
        captured.setdefault("inputs", (args, kwargs))

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    pipe(**dict(call, num_inference_steps=1))
    handle.remove()
    return captured["inputs"]


STEP_INPUTS = ("hidden_states", "timestep")  # what a pipeline's denoiser gets anew at every step


def _host(model, inputs, kwargs, calls: int, workers: list[psutil.Process]) -> tuple[float, float, float]:
    """CPU seconds of ``calls`` calls: the calling thread's, the process's, the workers'. Each call gets new latents
    and a new timestep, as a pipeline's steps do (a worker is sent them; the prompt's tensors, the same objects
    every step, it keeps); the copies are made before the clock starts."""
    steps = [{**kwargs, **{k: kwargs[k].clone() for k in STEP_INPUTS if k in kwargs}} for _ in range(calls)]
    mine, process, theirs = time.thread_time(), time.process_time(), _cpu(workers)
    for step in steps:
        model(*inputs, **step)
    return time.thread_time() - mine, time.process_time() - process, _cpu(workers) - theirs


def per_rank(scale: int, calls: int, ranks: str, rounds: int = 5) -> tuple[float, float, float]:
    """Host CPU seconds per transformer call (the tiny Flux's, channels x ``scale``) of a plain call, and of rank 0
    and of the other rank of a sequence split over two ranks on the CPU (``ranks``: "thread" or "process"). The
    plain transformer (a second build, same weights) and the split one run in the same process, in alternating
    rounds of ``calls`` calls each, so that both see the same machine (a shared one's load moves a plain call's CPU
    time by 1.5x from one minute to the next). With threads, rank 0 is the calling thread's CPU time and the other
    rank the rest of the process's (its thread); with processes, rank 0 is the caller's process (gloo's threads
    included) and the other the worker's. psutil reads a child's CPU time in 10 ms steps: totals, divided."""
    pipe, call, _ = case("flux", scale, 1)
    inputs, kwargs = transformer_inputs(pipe, call)
    plain, model = case("flux", scale, 1)[0].transformer, pipe.transformer
    sums = [0.0, 0.0, 0.0]
    try:
        with torch.no_grad():
            os.environ["PIPEMAP_WORKERS"] = ranks
            pipemap.dispatch(pipe, with_copy(pipe, "sequence", "transformer").remap(onto("cpu")))
            for _ in range(3):
                model(*inputs, **kwargs), plain(*inputs, **kwargs)
            workers = [psutil.Process(pid) for pid in getattr(model._hf_hook, "pids", list)()]
            for _ in range(rounds):
                sums[0] += _host(plain, inputs, kwargs, calls, [])[0]
                mine, process, theirs = _host(model, inputs, kwargs, calls, workers)
                sums[1] += mine if ranks == "thread" else process
                sums[2] += process - mine if ranks == "thread" else theirs
    finally:
        pipemap.reset(pipe)
        os.environ.pop("PIPEMAP_WORKERS", None)
    return sums[0] / (rounds * calls), sums[1] / (rounds * calls), sums[2] / (rounds * calls)


def _bare_all_to_all(rank: int, port: int, shape: tuple[int, ...], count: int, found) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    parts = torch.randn(shape)
    arrived = torch.empty_like(parts)
    for _ in range(20):
        torch.distributed.all_to_all_single(arrived, parts)
    torch.distributed.barrier()
    cpu = time.process_time()
    for _ in range(count):
        torch.distributed.all_to_all_single(arrived, parts)
    found.put((rank, (time.process_time() - cpu) / count))
    torch.distributed.destroy_process_group()


def collective_cost(shape: tuple[int, ...] = (2, 64, 3, 1, 2, 16), count: int = 1000) -> float:
    """Process CPU seconds (gloo's threads included) of one bare gloo all-to-all between two processes on loopback,
    of the tiny Flux's stacked queries, keys and values (``shape``), the mean of the two ranks: the floor a
    sequence split's collective costs the host here, whatever pipemap does around it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    found = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_bare_all_to_all, args=(port, shape, count, found), nprocs=2, start_method="spawn")
    return sum(found.get()[1] for _ in range(2)) / 2


def per_rank_table(scales: tuple[int, ...], calls: int) -> str:
    rows = ["| transformer | ranks | plain call CPU (ms) | rank 0 CPU (ms) | other rank CPU (ms) | rank 0 / plain | "
            "other / plain |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for scale in scales:
        for ranks in ("thread", "process"):
            plain, first, other = per_rank(scale, calls, ranks)
            rows.append(f"| flux x{scale}, sequence over 2 | {ranks} | {plain * 1e3:.2f} | {first * 1e3:.2f} | "
                        f"{other * 1e3:.2f} | {first / plain:.2f} | {other / plain:.2f} |")
            print(rows[-1], flush=True)
    bare, model = collective_cost(), tiny.build("flux").transformer
    count = 2 * (len(model.transformer_blocks) + len(model.single_transformer_blocks)) + 1
    rows += ["", f"gloo alone: one bare all-to-all of the tiny Flux's stacked queries, keys and values costs each of "
             f"two processes {bare * 1e6:.0f} us of CPU (gloo's threads included); a tiny Flux call's split makes "
             f"{count} collectives (two per attention layer, one gather): {count * bare * 1e3:.2f} ms a rank, "
             "before any of pipemap's own work"]
    print(rows[-1], flush=True)
    return "\n".join(rows)


def exchange_ab(calls: int, rounds: int = 8) -> str:
    """Rank 0's host CPU per tiny Flux transformer call of the sequence split, its stacked exchange taken straight
    (``ulysses.exchange``: torch.distributed's all-to-all into a buffer) against diffusers' functional all-to-all
    (``attention_dispatch._all_to_all_single``), alternating rounds of ``calls`` calls in one process (the wire is
    the same, so the worker needs no change); thread time of the calling thread and the process's CPU time."""
    from diffusers.models import attention_dispatch

    from pipemap.hooks import ulysses

    ways = {"straight": ulysses.exchange, "functional": attention_dispatch._all_to_all_single}
    rows = ["| ranks | exchange | rank 0 calling thread CPU (ms) | rank 0 process CPU (ms) |",
            "| --- | --- | ---: | ---: |"]
    for ranks in ("thread", "process"):
        pipe, call, _ = case("flux", 1, 1)
        inputs, kwargs = transformer_inputs(pipe, call)
        model, sums = pipe.transformer, {name: [0.0, 0.0] for name in ways}
        try:
            with torch.no_grad():
                pipemap.dispatch(pipe, with_copy(pipe, "sequence", "transformer").remap(onto("cpu")), ranks=ranks)
                for _ in range(3):
                    model(*inputs, **kwargs)
                for _ in range(rounds):
                    for name, way in ways.items():
                        ulysses.exchange = way
                        mine, process, _theirs = _host(model, inputs, kwargs, calls, [])
                        sums[name][0] += mine
                        sums[name][1] += process
        finally:
            ulysses.exchange = ways["straight"]
            pipemap.reset(pipe)
        for name, (mine, process) in sums.items():
            rows.append(f"| {ranks} | {name} | {mine / (rounds * calls) * 1e3:.2f} | "
                        f"{process / (rounds * calls) * 1e3:.2f} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def table_rows(name: str, found: dict[str, tuple[float, float, float] | str]) -> list[str]:
    plain = found.get("plain")
    rows = []
    for ranks, figures in found.items():
        if isinstance(figures, str) or isinstance(plain, str) or plain is None:
            rows.append(f"| {name} | {ranks} | {figures if isinstance(figures, str) else 'plain failed'} "
                        "| | | | | |")
            continue
        (wall, cpu, every), (plain_wall, plain_cpu, _) = figures, plain
        rows.append(f"| {name} | {ranks} | {wall:.3f} | {cpu:.3f} | {every:.3f} | "
                    f"{wall / plain_wall:.2f} | {cpu / plain_cpu:.2f} | {every / plain_cpu:.2f} |")
    return rows


def describe_machine(args) -> str:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return (f"`bench/workers.py --device {args.device} --repeats {args.repeats} --scale {args.scale} --steps "
            f"{args.steps}`: {os.cpu_count()} cores, GPUs {gpus or 'none'}, torch {torch.__version__}; the plan's "
            f"GPUs onto {onto(args.device)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scale", type=int, default=8, help="channel multiplier of the mid-size pipeline")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, help="write the table to OUT/workers.md (RESULTS.md untouched)")
    parser.add_argument("--only", help="comma-separated pipelines of the table (sd, flux, flux-true-cfg)")
    parser.add_argument("--per-rank", type=int, metavar="CALLS", help="instead of the table: each rank's host CPU "
                        "per transformer call of the Flux sequence split (x1 and x--scale), over CALLS calls")
    parser.add_argument("--ray", action="store_true", help="also the worker as a Ray actor (PIPEMAP_WORKERS=ray; "
                        "a local Ray of this machine's CPUs is started)")
    parser.add_argument("--exchange-ab", type=int, metavar="CALLS", help="instead of the table: rank 0's host CPU "
                        "per tiny Flux call with the stacked exchange straight against diffusers' functional one")
    args = parser.parse_args()
    if args.exchange_ab:
        table = exchange_ab(args.exchange_ab)
        print(table)
        if not args.no_record:
            record(f"bench/workers.py --exchange-ab {args.exchange_ab}", table, "- rank 0 of the tiny Flux's "
                   "sequence split on the CPU (remapped), 8 alternating rounds; the worker's exchange unchanged")
        return
    if args.per_rank:
        table = per_rank_table((1, args.scale), args.per_rank)
        print(table)
        if not args.no_record:
            record(f"bench/workers.py --per-rank {args.per_rank} --scale {args.scale}", table,
                   "- per transformer call, each rank's host CPU time against a plain call's, on the CPU (compute "
                   "included: at x1 it is a small part); the tiny Flux's transformer, its tokens split over two "
                   "ranks (Ulysses), gloo between processes")
        return
    ranks_of = (*RANKS, "ray") if args.ray else RANKS
    if args.ray:
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    rows = ["| pipeline | ranks | wall per call (s) | caller CPU (s) | all ranks' CPU (s) | wall / plain | "
            "caller CPU / plain | all CPU / plain |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    cases = [("sd", 1, "replicated"), ("sd", args.scale, "replicated"), ("flux", 1, "sequence"),
             ("flux", args.scale, "sequence"), ("flux-true-cfg", 1, "guidance"),
             ("flux-true-cfg", 1, "guidance_sequence"), ("flux-true-cfg", args.scale, "guidance_sequence")]
    only = set(args.only.split(",")) if args.only else None
    for kind, scale, mode in cases:
        if only is not None and kind not in only:
            continue
        found = measure(kind, scale, args.steps, args.repeats, args.device, ranks_of, mode)
        rows += table_rows(f"{kind} x{scale}, {mode}", found)
        print("\n".join(rows[-len(ranks_of):]), flush=True)
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "workers.md").write_text(f"{describe_machine(args)}\n\n{table}\n", encoding="utf-8")
        return
    if args.no_record:
        return
    record(f"bench/workers.py --repeats {args.repeats} --scale {args.scale} --steps {args.steps}"
           f"{' --ray' if args.ray else ''}{' --only ' + args.only if args.only else ''}", table,
           "- strategy parallel's modes on 2 GPUs (guidance_sequence: 4) remapped onto the CPU (sd: the CFG "
              "batch cut in halves; flux: tokens split; flux with true CFG: each step's second branch started ahead; "
           "guidance_sequence: each branch's tokens split over two GPUs); process: the other ranks worker "
           "processes (gloo), ray: the same as Ray actors, thread: threads of the caller")


def record(command: str, table: str, what: str) -> None:
    """The table appended to bench/RESULTS.md under a header naming the command, the machine and the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    header = (f"\n## {now} — `{command}`\n\n"
              f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n"
              f"- versions: torch {torch.__version__}, git {commit}\n{what}\n\n")
    with open(HERE / "RESULTS.md", "a", encoding="utf-8") as results:
        results.write(header + table + "\n")


if __name__ == "__main__":
    main()
