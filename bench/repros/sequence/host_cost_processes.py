"""Adapted copy of seq_host_cost.py (H1): host CPU time per transformer call, per rank, of the sequence split's
PROCESS path (PIPEMAP_WORKERS=process, hooks/sequence_workers.py) against a plain call, on the tiny Flux and on a
Flux transformer with 8x the tiny's widths (tiny.build("flux", scale=8)). Rank 0 = this process (time.process_time
delta), rank 1 = the worker process(es) (psutil cpu_times of the children). Prints ratios."""
import os, statistics, sys, time
os.environ["PIPEMAP_WORKERS"] = "process"
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import psutil, torch, pipemap
from helpers import with_copy
from pipemap import tiny
sys.path.insert(0, os.path.dirname(__file__))
from host_cost_threads import transformer_inputs

def children_cpu():
    t = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            ct = c.cpu_times(); t += ct.user + ct.system
        except psutil.Error:
            pass
    return t

def measure(fn, n):
    mine, theirs, wall = [], [], []
    for _ in range(n):
        c0, p0, w0 = children_cpu(), time.process_time(), time.perf_counter()
        fn()
        mine.append(time.process_time() - p0); theirs.append(children_cpu() - c0); wall.append(time.perf_counter() - w0)
    return statistics.median(mine), statistics.median(theirs), statistics.median(wall)

def main():
    torch.set_num_threads(1)
    n = int(os.environ.get("N", "20"))
    for scale in (1, 8):
        pipe = tiny.build("flux", scale=scale); pipe.set_progress_bar_config(disable=True)
        call = dict(tiny.default_call(pipe, "flux", output_type="pt"))
        args, kwargs = transformer_inputs(pipe, call)
        model = pipe.transformer
        with torch.no_grad():
            plain = measure(lambda: model(*args, **kwargs), n)
            pipemap.dispatch(pipe, with_copy(pipe, "sequence", hardware="2x2GiB,cpu=8GiB").remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
            for _ in range(3):
                model(*args, **kwargs)
            split = measure(lambda: model(*args, **kwargs), n)
        pipemap.reset(pipe)
        print(f"scale {scale}: plain call CPU {plain[0]*1e3:.2f} ms (wall {plain[2]*1e3:.2f}); split over processes: "
              f"rank 0 CPU {split[0]*1e3:.2f} ms ({split[0]/plain[0]:.2f}x plain), worker CPU {split[1]*1e3:.2f} ms "
              f"({split[1]/plain[0]:.2f}x plain), wall {split[2]*1e3:.2f} ms ({split[2]/plain[2]:.2f}x)")

if __name__ == "__main__":
    main()
