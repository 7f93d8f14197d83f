"""(c) lifetime and (d) exposure of the worker processes (PIPEMAP_WORKERS=process, gloo on the CPU), on the tiny
Flux's transformer split by tokens (mode "sequence", a plan for 2 GPUs remapped onto the CPU), or its guidance branch.

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests:bench/repros/workers nice -n 10 python \
      bench/repros/workers/lifetime_and_exposure.py
(it re-runs itself as child processes for the exit and SIGKILL cases). Prints a line per case: what happened, how
long it took, leftover worker processes, /dev/shm entries and listening sockets.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PIPEMAP_WORKERS"] = "process"
os.environ["PIPEMAP_WORKER_TIMEOUT"] = os.environ.get("PIPEMAP_WORKER_TIMEOUT", "120")
os.environ["PIPEMAP_REVIEW_CALLER"] = str(os.getpid())

import psutil  # noqa: E402
import torch  # noqa: E402

import pipemap  # noqa: E402
from helpers import processes_gone, with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


def shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def listening(pids) -> list[str]:
    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            found.append(f"pid {c.pid} {'rank0' if c.pid == os.getpid() else 'worker'} {c.laddr.ip}:{c.laddr.port}")
    return sorted(found)


def build(mode: str = "sequence"):
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=3)
    if mode == "guidance":
        call = dict(call, negative_prompt="blurry", true_cfg_scale=2.0)
    return pipe, call


def run(pipe, call):
    return torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)


def placed(mode: str = "sequence"):
    pipe, call = build(mode)
    plain = run(pipe, call)
    pipemap.dispatch(pipe, with_copy(pipe, mode).remap(ON_CPU))
    return pipe, call, plain, pipe.transformer._hf_hook


def outcome(fn):
    t0 = time.monotonic()
    try:
        value = fn()
        return time.monotonic() - t0, "ok", value
    except BaseException as err:  # noqa: BLE001
        return time.monotonic() - t0, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}", None


def child(kind: str) -> None:
    """Run as a child: dispatch, print the workers' pids and ports, then exit normally or wait to be killed."""
    pipe, call, _plain, hook = placed()
    run(pipe, call)
    pids = hook.pids()
    print(json.dumps({"pids": pids, "listen": listening({os.getpid(), *pids})}), flush=True)
    if kind == "exit":
        return  # interpreter exit with the pipeline still placed
    if kind == "exit-busy":  # exit while rank 0's main thread is not in a call, workers idle
        sys.exit(0)
    time.sleep(600)  # wait for SIGKILL


def main() -> None:
    shm0 = shm()
    print(f"tmp: PIPEMAP_WORKER_TIMEOUT={os.environ['PIPEMAP_WORKER_TIMEOUT']} s")

    # 1. what listens, and whether the store answers on a non-loopback address
    pipe, call, plain, hook = placed()
    pids = hook.pids()
    print("listening sockets of rank 0 and its worker:", listening({os.getpid(), *pids}))
    store = hook.ranks.store
    port = store.port
    addrs = [a.address for ifs in psutil.net_if_addrs().values() for a in ifs
             if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for ip in addrs:
        probe = subprocess.run([sys.executable, "-c", (
            "import datetime, torch.distributed as d;"
            f"s=d.TCPStore('{ip}', {port}, is_master=False, timeout=datetime.timedelta(seconds=5));"
            "print('connected from outside loopback; keys in store:', s.num_keys());"
            "s.set('pipemap/intruder', b'x'); print('wrote a key without any credential')")],
            capture_output=True, text=True, timeout=60)
        print(f"store {ip}:{port} ->", (probe.stdout or probe.stderr).strip().splitlines()[-2:])

    # 2. worker killed between calls
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(0.5)
    took, what, out = outcome(lambda: run(pipe, call))
    eq = out is not None and (out - plain).abs().max().item() <= 1e-4
    print(f"killed between calls: next call {what} in {took:.1f}s, equals plain: {eq}, new workers {hook.pids()}")

    # 3. worker killed during a call (at the second transformer call)
    seen = []

    def kill_mid(module, args, kwargs):
        seen.append(1)
        if len(seen) == 2:
            os.kill(hook.pids()[0], signal.SIGKILL)

    handle = pipe.transformer.register_forward_pre_hook(kill_mid, with_kwargs=True)
    took, what, out = outcome(lambda: run(pipe, call))
    handle.remove()
    print(f"killed during a call (sequence split): {what} after {took:.1f}s")
    took, what, out = outcome(lambda: run(pipe, call))
    eq = out is not None and (out - plain).abs().max().item() <= 1e-4
    print(f"  the call after: {what} in {took:.1f}s, equals plain: {eq}")
    pipemap.reset(pipe)
    print(f"  after reset: workers gone {processes_gone(pids + hook.pids())}")

    # 4. a worker rank raising inside the split (its GPU out of memory), not dying: the others wait in a collective
    from raising_processor import RaisingInWorker

    pipe, call = build()
    plain = run(pipe, call)
    pipe.transformer.set_attn_processor(RaisingInWorker())
    flag = os.path.join(tempfile.mkdtemp(), "raise")
    os.environ["PIPEMAP_REVIEW_RAISE"] = flag  # set before the workers start: they inherit it
    took, what, _ = outcome(lambda: pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU)))
    print(f"custom processor (importable module) dispatched: {what} in {took:.1f}s")
    hook = pipe.transformer._hf_hook
    took, what, out = outcome(lambda: run(pipe, call))
    eq = out is not None and (out - plain).abs().max().item() <= 1e-4
    print(f"  a call with it: {what} in {took:.1f}s, equals plain {eq}")
    open(flag, "w").close()
    took, what, _ = outcome(lambda: run(pipe, call))
    print(f"worker rank raised inside the split (rank 0 in the same collective): {what} after {took:.1f}s "
          f"(PIPEMAP_WORKER_TIMEOUT={os.environ['PIPEMAP_WORKER_TIMEOUT']})")
    os.remove(flag)
    took, what, out = outcome(lambda: run(pipe, call))
    eq = out is not None and (out - plain).abs().max().item() <= 1e-4
    print(f"  the call after: {what} in {took:.1f}s, equals plain: {eq}")
    pids = hook.pids()

    # 5. del pipe (no reset)
    del pipe, hook
    gc.collect()
    print(f"del pipe + gc.collect(): workers gone within 10 s: {processes_gone(pids)}")

    # 6-7. interpreter exit; caller SIGKILLed (child processes of this script)
    for kind in ("exit", "kill"):
        before = shm()
        proc = subprocess.Popen([sys.executable, __file__, "--child", kind], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        info = json.loads(line)
        t0 = time.monotonic()
        if kind == "kill":
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        gone = processes_gone(info["pids"], within_s=15)
        left = [p for p in info["pids"] if psutil.pid_exists(p)]
        ports = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in info["pids"]]
        print(f"caller {'exited normally' if kind == 'exit' else 'SIGKILLed'} with workers {info['pids']} "
              f"(listening: {info['listen']}): workers gone {gone} after {time.monotonic() - t0:.1f}s, left {left}, "
              f"their listening sockets left {len(ports)}, new /dev/shm entries {sorted(shm() - before)}")
    print(f"/dev/shm entries new since start: {sorted(shm() - shm0)}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
