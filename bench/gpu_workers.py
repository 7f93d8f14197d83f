"""The worker-process path where it matters: on GPUs (NCCL between two, gloo through the host where both ranks share
one), what the CPU tests prove over gloo (WP14 of bench/repros/workers/REVIEW.md): each split mode equals the plain
pipeline, a worker killed inside a sequence split is ``WorkerDiedError`` within seconds, a worker failing inside it
(out of memory) is its own typed error within seconds (on NCCL: the group aborted, not the watchdog ending this
process), and the call after each works on new workers.

    python bench/gpu_workers.py OUT_DIR                  # on a GPU machine (bench/gpu_run.sh runs it)
    python bench/gpu_workers.py OUT_DIR --device cpu     # here: the same checks over gloo on the CPU

Writes OUT_DIR/gpu_workers.md and .json; prints the table. Exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.py, worker_faults.py

import torch  # noqa: E402

import pipemap  # noqa: E402
from helpers import processes_gone, with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402
from worker_faults import RaisingInWorker  # noqa: E402

TOLERANCE = 1e-3  # float32 on a GPU against the CPU's plain run (TF32 off by default for fp32 matmuls)


def _call(pipe) -> dict:
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=3)
    return dict(call, negative_prompt="blurry", true_cfg_scale=2.0)  # two transformer calls a step


def _run(pipe, call) -> torch.Tensor:
    return torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images).float().cpu()


def _mapping(device: str) -> dict[str, str]:
    if device == "cpu":
        return {f"cuda:{i}": "cpu" for i in range(4)}
    gpus = torch.cuda.device_count()
    return {f"cuda:{i}": f"cuda:{min(i, gpus - 1)}" for i in range(4)}  # one GPU: every rank on it (gloo)


def _timed(what):
    start = time.monotonic()
    try:
        return what(), None, time.monotonic() - start
    except BaseException as err:  # noqa: BLE001 - the error is the row's outcome
        return None, err, time.monotonic() - start


def check_mode(mode: str, device: str) -> dict:
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = _call(pipe)
    if mode == "replicated":  # a batch to cut: two images a prompt
        call = dict(call, num_images_per_prompt=2)
    plain = _run(pipe, call)
    copies = 3 if mode == "guidance_sequence" else 1
    plan = with_copy(pipe, mode, hardware=f"{copies + 1}x64MiB,cpu=1GiB", copies=copies)
    pipemap.dispatch(pipe, plan.remap(_mapping(device)), ranks="process")
    hook = pipe.transformer._hf_hook
    out, err, took = _timed(lambda: _run(pipe, call))
    diff = float((out - plain).abs().max()) if out is not None else None
    row = {"check": f"{mode}: equals plain", "ok": err is None and diff is not None and diff <= TOLERANCE,
           "seconds": took, "detail": f"max diff {diff:.2e}" if diff is not None else repr(err),
           "transport": hook.ranks.describe() if hook.ranks is not None and hook.runtime != "thread" else "-"}
    pids = hook.pids()
    pipemap.reset(pipe)
    row["ok"] = row["ok"] and processes_gone(pids)
    return row


def check_failures(device: str) -> list[dict]:
    flag = os.path.join(tempfile.mkdtemp(), "raise")
    os.environ["PIPEMAP_TEST_RAISE"], os.environ["PIPEMAP_TEST_CALLER"] = flag, str(os.getpid())
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.set_attn_processor(RaisingInWorker())
    call = _call(pipe)
    plain = _run(pipe, call)
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(_mapping(device)), ranks="process")
    hook, rows = pipe.transformer._hf_hook, []
    _run(pipe, call)  # the workers warm
    open(flag, "w").close()
    _, err, took = _timed(lambda: _run(pipe, call))
    os.remove(flag)
    rows.append({"check": "worker out of memory inside the split", "seconds": took, "detail": repr(err)[:160],
                 "ok": isinstance(err, torch.OutOfMemoryError) and took < 10})
    (pid,) = hook.live_ranks().pids()  # new workers since the failure
    seen: list[int] = []

    def kill_second(module, args, kwargs):
        seen.append(1)
        if len(seen) == 2:
            os.kill(pid, signal.SIGKILL)

    handle = pipe.transformer.register_forward_pre_hook(kill_second, with_kwargs=True)
    _, err, took = _timed(lambda: _run(pipe, call))
    handle.remove()
    rows.append({"check": "worker killed inside the split", "seconds": took, "detail": repr(err)[:160],
                 "ok": isinstance(err, pipemap.WorkerDiedError) and took < 10})
    out, err, took = _timed(lambda: _run(pipe, call))
    diff = float((out - plain).abs().max()) if out is not None else None
    rows.append({"check": "the call after, on new workers", "seconds": took, "ok": diff is not None and
                 diff <= TOLERANCE, "detail": f"max diff {diff:.2e}" if diff is not None else repr(err)[:160]})
    pipemap.reset(pipe)
    return rows


def _guarded(name: str, check) -> list[dict]:
    """The rows of ``check``, or one row saying what stopped it."""
    start = time.monotonic()
    try:
        return check()
    except Exception as err:  # noqa: BLE001 - the table says what stopped it; the other checks still run
        return [{"check": name, "ok": False, "seconds": time.monotonic() - start, "detail": repr(err)[:200]}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    os.environ.setdefault("PIPEMAP_WORKER_TIMEOUT", "60")
    rows = []
    modes = ["sequence", "guidance", "replicated"]
    if args.device == "cpu" or torch.cuda.device_count() >= 4:
        modes.append("guidance_sequence")
    for mode in modes:
        rows.append(_guarded(f"{mode}: equals plain", lambda m=mode: [check_mode(m, args.device)])[0])
    rows += _guarded("failures inside a split", lambda: check_failures(args.device))
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    lines = [f"gpu_workers.py on {args.device} ({gpus} GPU(s)), torch {torch.__version__}", "",
             "| check | ok | seconds | detail |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r['check']} | {'yes' if r['ok'] else 'NO'} | {r['seconds']:.1f} | {r['detail']} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_workers.md").write_text(text + "\n")
    (args.out / "gpu_workers.json").write_text(json.dumps(rows, indent=2, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
