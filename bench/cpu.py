"""CPU benchmarks for pipemap: each figure is a ratio against its peer measured in the same run.

    python bench/cpu.py --quick          # under a minute on 2 cores
    python bench/cpu.py                  # a few minutes; mid-size pipeline at --scale 12 (about 1 s per call)
    python bench/cpu.py --only hooks     # one section

Sections (each one function ``bench_<name>(ctx) -> list[Row]``, registered in ``SECTIONS``):

- ``plan``:  ``pipemap.plan(folder)`` reads headers only: bytes read (``rchar`` of ``/proc/self/io``) vs the
  weight bytes in the folder, and the time one plan takes.
- ``hooks``: one loaded pipeline called plain, dispatched on a CPU plan, and dispatched on a 2-GPU plan remapped to
  the CPU; interleaved repeats, medians, ratio dispatched / plain.
- ``load``:  ``pipemap.load`` vs ``DiffusionPipeline.from_pretrained``, each in a fresh child process (wall time and
  peak RSS above the post-import baseline), alternating, medians, ratio pipemap / diffusers; on sd x14 (1.07 GiB;
  x8 with --quick) and the tiny sd.
- ``offload``: weights moved for one image under a one-GPU offloading plan (a budget that forces offload, remapped
  onto the CPU) vs diffusers' ``enable_model_cpu_offload`` (``pipemap.dispatch.traffic.bytes_moved_per_image``).
- ``catalog``: ``pipemap.plan(name, strategy="auto")`` for each catalog entry, first and cached call; the strategy
  chosen and its predicted seconds per image.
- ``dry_run``: ``pipemap.simulate`` wall time from a loaded pipeline and from a folder, first and second call.
- ``imports``: ``import pipemap``, ``pipemap --help`` and ``pipemap catalog`` in fresh processes vs
  ``python -c "import torch"`` (alternating, medians, ratio pipemap / torch); and, where ``.venv`` is set up, a
  second ``bash scripts/demo.sh`` (setup skipped by its stamp) in seconds.
- ``parallel``: speed from a second device, on the mid-size SD with 2 Python threads on 2 cores (1 intra-op thread
  each): ``pipemap.run_many`` (2 workers) against the same calls one by one on a 2-stage layout (text encoder and
  VAE on one GPU, unet on the other, remapped onto the CPU), images per second; denoiser replicas (strategy
  ``"parallel"``, each copy on its own thread) against one device (1 intra-op thread, then 2), seconds per image.
- ``ram``: peak RSS over a load and one call of a 1.1 GiB pipeline built in code (sd x14; x8 with --quick):
  ``pipemap.load`` onto a plan whose RAM budget is a quarter of the weights (the rest on the disk tier; one GPU of
  another quarter, remapped onto the CPU) vs ``DiffusionPipeline.from_pretrained``, fresh processes, ratio pipemap /
  diffusers; and pipemap's peak against the plan's figure.

The table is printed and appended to ``bench/RESULTS.md``; the last line printed is ``summary: name=value ...``.
See bench/README.md for how to read each figure.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
TINY_KINDS = ("sd", "sdxl", "controlnet")
PLAN_HARDWARE = "2x24GiB,cpu=64GiB"
CPU_HARDWARE = "cpu=64GiB"


# ---- what a section returns ----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One figure: pipemap's value, its peer's, and their ratio (lower is better unless the target says otherwise)."""

    section: str
    pipeline: str
    metric: str
    ours: float
    peer: float | None = None
    unit: str = ""
    target: str = ""
    note: str = ""

    paired: float | None = None  # the median of ratios taken pair by pair, where the figure has pairs

    @property
    def ratio(self) -> float | None:
        if self.paired is not None:
            return self.paired
        return self.ours / self.peer if self.peer else None


@dataclass
class Context:
    """What every section shares: options, a scratch folder, saved pipelines (built once) and the summary."""

    quick: bool
    scale: int
    repeats: int
    load_repeats: int
    warm_loads: int
    work: Path
    summary: dict[str, str] = field(default_factory=dict)
    _folders: dict[tuple[str, int], Path] = field(default_factory=dict)

    def folder(self, kind: str, scale: int = 1) -> Path:
        """The tiny pipeline ``kind`` at ``scale`` saved under the scratch folder (fp32 files plus an fp16 variant)."""
        key = (kind, scale)
        if key not in self._folders:
            from pipemap import tiny

            path = self.work / f"{kind}-x{scale}"
            with quiet():
                tiny.save(kind, path, scale=scale)
            self._folders[key] = path
        return self._folders[key]

    def pipelines(self) -> list[tuple[str, str, int]]:
        """``(label, kind, scale)`` for the tiny pipelines and the mid-size one."""
        return [(kind, kind, 1) for kind in TINY_KINDS] + [(f"sd x{self.scale}", "sd", self.scale)]


# ---- section: planning reads headers only --------------------------------------------------------------------------


def bench_plan(ctx: Context) -> list[Row]:
    """Bytes read and time taken by ``pipemap.plan(folder)``, against the headers and the weights in the folder."""
    import pipemap

    rows = []
    for label, kind, scale in ctx.pipelines():
        folder = ctx.folder(kind, scale)
        pipemap.plan(folder, hardware=PLAN_HARDWARE)  # warm: lazy imports read .py files, which rchar would count
        before = rchar()
        pipemap.plan(folder, hardware=PLAN_HARDWARE)
        read = rchar() - before - RCHAR_SELF
        times = [timed(lambda f=folder: pipemap.plan(f, hardware=PLAN_HARDWARE)) for _ in range(ctx.repeats)]
        needed, weights = header_bytes(folder), weight_bytes(folder)
        rows.append(Row("plan", label, "bytes read / (headers + json)", read, needed, "B", "<= 1.0",
                        f"{read / 1024:.1f} KiB read, of {weights / 2**20:.1f} MiB of safetensors"))
        rows.append(Row("plan", label, "bytes read / weight bytes", read, weights, "B", "< 0.01"))
        rows.append(Row("plan", label, "plan time", statistics.median(times) * 1e3, None, "ms", "",
                        f"median of {ctx.repeats}"))
    ctx.summary["plan_bytes_read"] = str(max(r.ours for r in rows if r.metric.endswith("weight bytes")))
    ctx.summary["plan_read_vs_headers"] = f"{max(r.ratio for r in rows if r.metric.endswith('json)')):.3f}"
    ctx.summary["plan_ms"] = f"{max(r.ours for r in rows if r.metric == 'plan time'):.1f}"
    return rows


def header_bytes(folder: Path) -> int:
    """What planning needs to read: each default (non-variant) safetensors file's length word and JSON header,
    ``model_index.json`` and the components' ``config.json``."""
    total = (folder / "model_index.json").stat().st_size
    total += sum(p.stat().st_size for p in folder.glob("*/config.json"))
    for path in folder.glob("*/*.safetensors"):
        if path.name.count(".") == 1:  # "model.safetensors", not "model.fp16.safetensors"
            with path.open("rb") as f:
                total += 8 + int.from_bytes(f.read(8), "little")
    return total


def rchar() -> int:
    """Bytes this process has passed through read()-like syscalls (page cache hits included; mmap faults not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


RCHAR_SELF = len(Path("/proc/self/io").read_bytes())  # reading the counter once counts its own text in rchar


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


# ---- section: hook overhead ----------------------------------------------------------------------------------------


def bench_hooks(ctx: Context) -> list[Row]:
    """Call time of one loaded pipeline: plain, dispatched on a CPU plan, and on a remapped 2-GPU plan."""
    rows = []
    for label, kind, scale in ctx.pipelines():
        repeats = ctx.repeats if scale == 1 else 6  # a multiple of 3: each variant runs first equally often
        times = hook_times(ctx.folder(kind, scale), kind, repeats)
        plain = statistics.median(times["plain"])
        for variant, name in (("cpu", "dispatched (cpu plan) / plain"), ("remap", "dispatched (2x24GiB remapped)"
                                                                                   " / plain")):
            ours = statistics.median(times[variant])
            rows.append(Row("hooks", label, name, ours * 1e3, plain * 1e3, "ms", "<= 1.02",
                            f"{(ours - plain) * 1e3:+.2f} ms/call, n={repeats}"))
    rows.append(component_call_row(ctx.folder("sd"), ctx.repeats))
    mid = [r for r in rows if r.pipeline.startswith("sd x")]
    tiny = [r for r in rows if not r.pipeline.startswith("sd x") and r.metric.startswith("dispatched")]
    ctx.summary["hook_overhead"] = f"{mid[0].ratio:.3f}"
    ctx.summary["hook_overhead_remap"] = f"{mid[1].ratio:.3f}"
    ctx.summary["hook_overhead_tiny_max"] = f"{max(r.ratio for r in tiny):.3f}"
    ctx.summary["hook_us_per_component_call"] = f"{rows[-1].ours - rows[-1].peer:.0f}"
    return rows


def hook_times(folder: Path, kind: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per call for each variant, interleaved (the order rotates each round) so drift hits all alike."""
    import numpy as np
    from diffusers import DiffusionPipeline

    import pipemap
    from pipemap import tiny

    with quiet():
        pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    plans = {"plain": None, "cpu": pipemap.plan(pipe, hardware=CPU_HARDWARE),
             "remap": pipemap.plan(pipe, hardware="2x24GiB").remap({"cuda:0": "cpu", "cuda:1": "cpu"})}
    call = lambda: pipe(**tiny.default_call(pipe, kind)).images  # noqa: E731
    reference = call()  # also warms: first-call allocations and lazy imports
    freeze_gc()
    times: dict[str, list[float]] = {name: [] for name in plans}
    names = list(plans)
    for i in range(repeats):
        for name in names[i % 3:] + names[: i % 3]:
            if plans[name] is not None:
                pipemap.dispatch(pipe, plans[name])
                if getattr(pipe.unet, "_hf_hook", None) is None:
                    raise RuntimeError(f"{kind}: dispatch left the unet without a hook; the figure would be void")
            gc.collect()
            start = time.perf_counter()
            images = call()
            times[name].append(time.perf_counter() - start)
            if plans[name] is not None:
                pipemap.reset(pipe)
            if i == 0 and not np.array_equal(images, reference):
                raise RuntimeError(f"{kind}: the {name!r} run's images differ from the plain run's")
    gc.unfreeze()
    return times


def component_call_row(folder: Path, repeats: int, calls: int = 50) -> Row:
    """The hook's own cost on one component call: the tiny SD text encoder (about a millisecond of compute) called
    directly, hooked vs plain, in microseconds per call.

    A whole pipeline call also differs in diffusers' ``_execution_device`` lookup, which is slower without hooks
    (about 1.3 ms vs 0.7 ms on the tiny SD here), so whole-call ratios can come out below 1.0.
    """
    import torch
    from diffusers import DiffusionPipeline

    import pipemap

    with quiet():
        pipe = DiffusionPipeline.from_pretrained(folder)
    plan = pipemap.plan(pipe, hardware=CPU_HARDWARE)
    ids = pipe.tokenizer(["a tiny cat"] * 2, padding="max_length", return_tensors="pt").input_ids
    freeze_gc()
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad():
        pipe.text_encoder(ids)
        for i in range(repeats):
            for hooked in (False, True) if i % 2 == 0 else (True, False):
                if hooked:
                    pipemap.dispatch(pipe, plan)
                start = time.perf_counter()
                for _ in range(calls):
                    pipe.text_encoder(ids)
                times[hooked].append((time.perf_counter() - start) / calls)
                if hooked:
                    pipemap.reset(pipe)
    gc.unfreeze()
    ours, peer = (statistics.median(times[h]) * 1e6 for h in (True, False))
    return Row("hooks", "sd text_encoder", "one forward, hooked / plain", ours, peer, "us", "",
               f"{ours - peer:+.0f} us per hooked call, n={repeats}x{calls}")


def freeze_gc() -> None:
    """Collect once, then move every live object out of the collector's sight: with torch and diffusers loaded a
    full ``gc.collect()`` takes 0.2-0.3 s here, and the benches collect before each timed step."""
    gc.collect()
    gc.freeze()


# ---- section: load time and memory ---------------------------------------------------------------------------------


LOADERS = ("pipemap", "diffusers")


def bench_load(ctx: Context) -> list[Row]:
    """``pipemap.load`` vs ``DiffusionPipeline.from_pretrained``, each in fresh processes started alternately."""
    rows = []
    big = load_scale(ctx)
    for label, kind, scale, repeats in ((f"sd x{big}", "sd", big, ctx.load_repeats),
                                        ("sd", "sd", 1, max(1, ctx.load_repeats - 2))):
        folder = ctx.folder(kind, scale)
        runs: dict[str, list[dict]] = {name: [] for name in LOADERS}
        for i in range(repeats):  # ABBA order: neither loader always runs first
            for name in LOADERS if i % 2 == 0 else LOADERS[::-1]:
                runs[name].append(child_load(name, folder, ctx.warm_loads))
        note = f"{repeats} processes per loader"
        for metric, key, unit, target in LOAD_METRICS:
            factor = 2**-20 if unit == "MiB" else 1
            ours, peer = (statistics.median(x for r in runs[n] for x in listed(r[key])) * factor for n in LOADERS)
            rows.append(Row("load", label, metric, ours, peer, unit, target, note))
        pairs = [pair for name in LOADERS for r in runs[name] for pair in r["pairs"]]
        rows.append(Row("load", label, "load time, warm, paired", statistics.median(p["pipemap"] for p in pairs),
                        statistics.median(p["diffusers"] for p in pairs), "s", LOAD_TIME_TARGET,
                        f"{len(pairs)} pairs in {2 * repeats} processes; median of pair ratios",
                        statistics.median(p["pipemap"] / p["diffusers"] for p in pairs)))
    ratios = {(r.pipeline, r.metric): r.ratio if r.ratio is not None else float("nan") for r in rows}
    for suffix, label in (("", f"sd x{big}"), ("_tiny", "sd")):
        ctx.summary[f"load_time_ratio{suffix}"] = f"{ratios[label, 'load time, first in process']:.2f}"
        ctx.summary[f"load_time_warm_ratio{suffix}"] = f"{ratios[label, 'load time, warm, paired']:.2f}"
        ctx.summary[f"load_rss_ratio{suffix}"] = f"{ratios[label, 'peak RSS above imports']:.2f}"
        ctx.summary[f"load_touched_rss_ratio{suffix}"] = f"{ratios[label, 'peak RSS, weights touched']:.2f}"
    return rows


def load_scale(ctx: Context) -> int:
    """The larger pipeline the load section compares on: the ``ram`` section's 1.07 GiB (the issue asks for 1 GB or
    more; the folder is then built once for both), x8 (0.6 GiB) with --quick."""
    return 8 if ctx.quick else RAM_SCALE


# (metric, key in the child's report, unit, target); RSS keys are bytes above the post-import baseline. The targets
# as issue 38 restated them: pipemap's CPU load is diffusers' from_pretrained plus its plan, so parity is the floor;
# at most 1.05x for time and 1.02x for memory
LOAD_TIME_TARGET, LOAD_RSS_TARGET = "<= 1.05", "<= 1.02"
LOAD_METRICS = (
    ("load time, first in process", "first", "s", LOAD_TIME_TARGET),
    ("load time, warm", "warm", "s", ""),  # medians of each loader's own loads: see "warm, paired"
    ("peak RSS above imports", "peak", "MiB", LOAD_RSS_TARGET),
    ("anon RSS after load", "anon", "MiB", LOAD_RSS_TARGET),
    ("peak RSS, weights touched", "touched", "MiB", LOAD_RSS_TARGET),
)


def listed(value) -> list:
    return value if isinstance(value, list) else [value]


def child_load(loader: str, folder: Path, warm_loads: int) -> dict:
    """Run ``--child-load`` in a fresh interpreter; its last stdout line is a JSON dict."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-load", loader, str(folder),
           "--warm-loads", str(warm_loads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"child {loader} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_main(loader: str, folder: str, warm_loads: int) -> None:
    """In a fresh process: import everything, take the RSS baseline, load once (time, memory), then load again:
    ``warm_loads`` loads by ``loader`` alone, then ``warm_loads`` pairs, one load by each loader in turn.

    The peak is the kernel's high-water mark ``VmHWM``, reset after the imports (``/proc/self/clear_refs``), so it
    is the load's own peak above the post-import RSS, not the imports' (which ``ru_maxrss`` would keep). Both
    loaders memory-map safetensors, so weights count in RSS only once read: "touched" reads every tensor once, as
    the first call would, and reports the peak then.

    The pairs: on this shared machine a process runs at one speed for a second or so, then at nearly half of it
    (its CPU time grows as its wall time: not waiting but slower), so two loads measured in separate processes
    differ by up to 2x for nothing; two loads a tenth of a second apart in one process run at one speed.
    """
    import_everything(Path(folder))
    freeze_gc()
    reset_peak_rss()
    before = rss_status()
    start = time.perf_counter()
    pipe = load_with(loader, folder)
    first = time.perf_counter() - start
    after = rss_status()
    touch(pipe)
    touched = rss_status()
    del pipe
    gc.collect()
    warm = [timed_load(loader, folder) for _ in range(warm_loads)]
    other = next(name for name in LOADERS if name != loader)
    timed_load(other, folder)  # its first load in this process: its one-time costs, not timed
    pairs = []
    for i in range(warm_loads):  # each loader first in every other pair
        order = (loader, other) if i % 2 == 0 else (other, loader)
        pairs.append({name: timed_load(name, folder) for name in order})
    print(json.dumps({"first": first, "warm": warm or [first], "pairs": pairs,
                      "peak": after["VmHWM"] - before["VmRSS"], "touched": touched["VmHWM"] - before["VmRSS"],
                      "anon": after["RssAnon"] - before["RssAnon"], "file": after["RssFile"] - before["RssFile"]}))


def timed_load(loader: str, folder: str) -> float:
    """Seconds one load takes; the pipeline dropped and collected after."""
    start = time.perf_counter()
    pipe = load_with(loader, folder)
    took = time.perf_counter() - start
    del pipe
    gc.collect()
    return took


def reset_peak_rss() -> None:
    """Set ``VmHWM`` to the current RSS (Linux >= 4.0); without it the peak would include the imports' peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak RSS through /proc/self/clear_refs ({err})") from err


def rss_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon, RssFile of this process in bytes (copies are anonymous; mapped files not)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def touch(pipe) -> None:
    """Read every parameter and buffer once (as the first call would), faulting memory-mapped pages in."""
    import torch

    with torch.no_grad():
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                for tensor in (*module.parameters(), *module.buffers()):
                    tensor.sum()


def import_everything(folder: Path) -> None:
    """Import pipemap, diffusers, the pipeline class and every component class, so neither loader pays for it."""
    import importlib

    import diffusers

    import pipemap

    index = json.loads((folder / "model_index.json").read_text())
    getattr(diffusers, index["_class_name"])  # the pipeline class's module, imported on first use
    pipemap.load  # noqa: B018 -- the same for pipemap: its lazy name imports the loading verbs' module (api)
    for name, entry in index.items():
        if not name.startswith("_") and isinstance(entry, list) and entry[0]:
            getattr(importlib.import_module(entry[0]), entry[1])


def load_with(loader: str, folder: str):
    with quiet():
        if loader == "pipemap":
            import pipemap

            return pipemap.load(folder, hardware=CPU_HARDWARE, progress=False)
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.from_pretrained(folder)


# ---- section: RAM as a budget, the disk tier ----------------------------------------------------------------------

RAM_SCALE = 14  # tiny sd at this scale: about 1.1 GiB of fp32 weights (the issue asks for a pipeline of 1 GB or more)
RAM_SHARE = 4  # the plan's RAM budget (and its one GPU's) is the weights divided by this


def bench_ram(ctx: Context) -> list[Row]:
    """Peak RSS over a load and one call: ``pipemap.load`` onto a plan whose RAM budget is a quarter of the weights
    (one GPU of another quarter, remapped onto the CPU: its bytes are RAM here too) vs
    ``DiffusionPipeline.from_pretrained`` and the same call; each in a fresh process, outputs compared."""
    import pipemap

    scale = 8 if ctx.quick else RAM_SCALE
    folder = ctx.folder("sd", scale)
    total = sum(c.bytes for c in pipemap.inspect(folder).models)
    plan = pipemap.plan(folder, hardware=f"cuda:0={total // RAM_SHARE},cpu={total // RAM_SHARE}",
                        strategy="balanced_ultra_low_memory")
    plan_path = ctx.work / f"ram-plan-x{scale}.json"
    plan_path.write_text(plan.remap({"cuda:0": "cpu"}).to_json())
    runs = {name: child_ram(name, folder, plan_path, ctx.work / f"ram-{name}.npy") for name in LOADERS}
    import numpy as np

    diff = float(np.abs(np.load(ctx.work / "ram-pipemap.npy") - np.load(ctx.work / "ram-diffusers.npy")).max())
    planned = sum(d.used for d in plan.devices)  # RAM tier + staging, and the GPU's bytes (RAM here)
    label, mib = f"sd x{scale} ({total / 2**30:.2f} GiB)", 2**-20
    note = f"plan: RAM {plan.devices[-1].used * mib:.0f} MiB + GPU {plan.devices[0].used * mib:.0f} MiB; " \
           f"disk {(plan.host.disk + plan.host.kept) * mib:.0f} MiB; output max diff {diff:g}"
    rows = [Row("ram", label, "peak RSS above imports, load", runs["pipemap"]["loaded"] * mib,
                runs["diffusers"]["loaded"] * mib, "MiB", "<= 1.0"),
            Row("ram", label, "peak RSS above imports, load + 1 call", runs["pipemap"]["peak"] * mib,
                runs["diffusers"]["peak"] * mib, "MiB", "<= 1.0", note),
            Row("ram", label, "peak RSS, load + call, vs the plan's figure", runs["pipemap"]["peak"] * mib,
                planned * mib, "MiB", "<= 1 + margin", "peer: the plan's RAM and GPU bytes (both RAM here)"),
            Row("ram", label, "anon RSS growth, load + call (activations)", runs["pipemap"]["anon"] * mib,
                runs["diffusers"]["anon"] * mib, "MiB", "", "pipemap's holds the GPU's buffers and the staging")]
    ctx.summary["ram_peak_ratio"] = f"{rows[1].ratio:.2f}"
    ctx.summary["ram_peak_vs_plan"] = f"{rows[2].ratio:.2f}"
    ctx.summary["ram_output_diff"] = f"{diff:g}"
    return rows


def child_ram(loader: str, folder: Path, plan: Path, output: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-ram", loader, str(folder), str(plan), str(output)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"child {loader} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_ram_main(loader: str, folder: str, plan: str, output: str) -> None:
    """In a fresh process: import everything, reset the peak, load (onto ``plan`` for pipemap), call once; the
    peaks are ``VmHWM`` above the post-import RSS (mapped weights count once read, as RAM does)."""
    import numpy as np

    import pipemap
    from pipemap import tiny

    import_everything(Path(folder))
    freeze_gc()
    reset_peak_rss()
    before = rss_status()
    with quiet():
        if loader == "pipemap":
            pipe = pipemap.load(folder, plan=pipemap.Plan.from_json(Path(plan).read_text()), progress=False)
        else:
            from diffusers import DiffusionPipeline

            pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    loaded = rss_status()
    images = pipe(**tiny.default_call(pipe, "sd")).images
    after = rss_status()
    np.save(output, np.asarray(images))
    print(json.dumps({"loaded": loaded["VmHWM"] - before["VmRSS"], "peak": after["VmHWM"] - before["VmRSS"],
                      "anon": after["RssAnon"] - before["RssAnon"], "file": after["RssFile"] - before["RssFile"]}))


# ---- section: offload, bytes moved per image -----------------------------------------------------------------------


OFFLOADING = ("balanced_low_memory", "balanced_ultra_low_memory")
SHORT_STRATEGY = {"balanced_low_memory": "low_memory", "balanced_ultra_low_memory": "ultra_low"}


def bench_offload(ctx: Context) -> list[Row]:
    """Weights moved for one image under an offloading plan (one GPU, a budget that forces offload, remapped onto
    the CPU) vs diffusers' ``enable_model_cpu_offload``, through ``pipemap.dispatch.traffic.bytes_moved_per_image``."""
    from diffusers import DiffusionPipeline

    import pipemap
    from pipemap import tiny
    from pipemap.dispatch import traffic

    rows = []
    for kind in TINY_KINDS:
        with quiet():
            pipe = DiffusionPipeline.from_pretrained(ctx.folder(kind))
        pipe.set_progress_bar_config(disable=True)
        inv = pipemap.inspect(pipe)
        call = tiny.default_call(pipe, kind)
        cases = [(strategy, forcing_budget(inv, strategy), "largest budget where balanced fails")
                 for strategy in OFFLOADING]
        if "text_encoder_2" in {c.name for c in inv.models}:
            # SDXL: the denoiser and the VAE stay resident, with room for one text encoder at a time
            encoders = max(inv[n].bytes for n in ("text_encoder", "text_encoder_2"))
            rest = inv["unet"].bytes + inv["vae"].bytes + encoders
            cases.append(("balanced_low_memory", rest + 4096, "unet + vae + largest text encoder"))
        cases.append(("balanced_low_memory", 2**30, "everything fits"))
        for strategy, budget, why in cases:
            hardware = pipemap.Hardware.parse(f"cuda:0={budget},cpu=1GiB")
            gpu_plan = pipemap.plan(inv, hardware=hardware, strategy=strategy, headroom=0.0)
            moved = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **call)
            away = ", ".join(f"{p.component} {p.mode}" for p in gpu_plan.components if p.mode != "resident")
            metric = f"bytes moved / image, {SHORT_STRATEGY[strategy]}"
            note = f"cuda:0={budget / 2**20:.2f} MiB ({why}); {away or 'all resident'}"
            if moved.diffusers_bytes == 0:
                raise RuntimeError(f"{kind}: diffusers' model offload moved nothing; the ratio would be void")
            rows.append(Row("offload", kind, metric, moved.pipemap_bytes, moved.diffusers_bytes, "B", "<= 1.0", note))
            if why == "everything fits" and moved.pipemap_bytes != 0:
                raise RuntimeError(f"{kind}: {moved.pipemap_bytes} bytes moved where everything fits")
    ctx.summary["offload_bytes_ratio_max"] = f"{max(r.ratio for r in rows):.3f}"
    return rows


def forcing_budget(inv, strategy: str, steps: int = 400) -> int:
    """The largest one-GPU budget at which "balanced" fails and ``strategy`` fits (``planner.forcing_hardware``)."""
    import pipemap
    from pipemap.planner import forcing_hardware

    return pipemap.Hardware.parse(forcing_hardware(inv, strategy, 1, steps)).memory("cuda:0")


# ---- section: planning from the catalog ----------------------------------------------------------------------------


CATALOG_HARDWARE = "2x16GiB,cpu=64GiB"


def bench_catalog(ctx: Context) -> list[Row]:
    """``pipemap.plan(name, strategy="auto")`` for each catalog entry: the first call (builds the models on the meta
    device and counts them) and a cached call; the strategy auto chose and its predicted seconds per image."""
    import pipemap
    from pipemap import catalog

    rows = []
    for name in catalog.names():
        plan = lambda n=name: pipemap.plan(n, hardware=CATALOG_HARDWARE, strategy="auto")  # noqa: E731
        first = timed(plan)
        cached = statistics.median(timed(plan) for _ in range(5))
        chosen = min((c for c in plan().candidates if c.seconds is not None), key=lambda c: c.seconds)
        note = f"auto -> {chosen.strategy}, {chosen.seconds:.3g} s/image predicted"
        rows.append(Row("catalog", name, "plan time, first call", first * 1e3, None, "ms", "", note))
        rows.append(Row("catalog", name, "plan time, cached", cached * 1e3, None, "ms", "", "median of 5"))
    ctx.summary["catalog_plan_ms_max"] = f"{max(r.ours for r in rows if r.metric.endswith('first call')):.0f}"
    ctx.summary["catalog_plan_ms_cached_max"] = f"{max(r.ours for r in rows if r.metric.endswith('cached')):.1f}"
    return rows


# ---- section: dry run ----------------------------------------------------------------------------------------------


DRY_RUN_HARDWARE = "2x5MiB,cpu=1GiB"


def bench_dry_run(ctx: Context) -> list[Row]:
    """Wall time of ``pipemap.simulate`` for each tiny pipeline, from a loaded pipeline and from its folder (no
    weight read), first and second call in this process."""
    from diffusers import DiffusionPipeline

    import pipemap

    rows = []
    for kind in TINY_KINDS:
        folder = ctx.folder(kind)
        with quiet():
            pipe = DiffusionPipeline.from_pretrained(folder)
        plan, strategy = dry_run_plan(folder)
        for label, source in (("loaded pipeline", pipe), ("folder", folder)):
            for which in ("first", "second"):
                with quiet():
                    start = time.perf_counter()
                    report = pipemap.simulate(source, plan)
                    seconds = time.perf_counter() - start
                if not report.ok:
                    raise RuntimeError(f"{kind}: the dry run from a {label} failed: {report.error}")
                rows.append(Row("dry_run", kind, f"simulate, {label}, {which} call", seconds, None, "s", "< 10",
                                f"{strategy} on {DRY_RUN_HARDWARE}; call itself {report.seconds:.2f} s"))
    ctx.summary["dry_run_s_max"] = f"{max(r.ours for r in rows):.2f}"
    return rows


def dry_run_plan(folder: Path):
    """The plan the dry run follows: "balanced" on two 5 MiB stand-in GPUs, headroom 0; "auto" where it does not fit."""
    import pipemap

    try:
        return pipemap.plan(folder, hardware=DRY_RUN_HARDWARE, headroom=0.0), "balanced"
    except pipemap.DoesNotFitError:
        return pipemap.plan(folder, hardware=DRY_RUN_HARDWARE, headroom=0.0, strategy="auto"), "auto"


# ---- section: imports and start-up ---------------------------------------------------------------------------------


REPO = HERE.parent


def bench_imports(ctx: Context) -> list[Row]:
    """Start-up of the package and the command line, each in a fresh process, against importing torch alone."""
    import importlib.util

    src = str(Path(importlib.util.find_spec("pipemap").origin).parent.parent)
    env = {**os.environ, "PYTHONPATH": src}
    commands = {"torch": [sys.executable, "-c", "import torch"],
                "import pipemap": [sys.executable, "-c", "import pipemap"],
                "pipemap --help": [sys.executable, "-m", "pipemap", "--help"],
                "pipemap catalog": [sys.executable, "-m", "pipemap", "catalog"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(3 if ctx.quick else 7):
        for name, command in commands.items():
            times[name].append(timed(lambda c=command: subprocess.run(c, env=env, check=True, capture_output=True)))
    torch_s = statistics.median(times["torch"])
    rows = [Row("imports", "-", f"{name}, fresh process", statistics.median(times[name]), torch_s, "s", "< 0.2x",
                f"median of {len(times[name])}; peer: python -c 'import torch'")
            for name in commands if name != "torch"]
    for row in rows:
        ctx.summary[row.metric.split(",")[0].replace(" ", "_").replace("--", "")] = f"{row.ratio:.3f}x"
    return rows + demo_rows(ctx, env)


def demo_rows(ctx: Context, env: dict) -> list[Row]:
    """A second ``bash scripts/demo.sh``: setup finds its stamp and skips every install. Needs ``.venv`` set up by
    a first run (or ``bash scripts/setup.sh``); skipped otherwise."""
    if not (REPO / ".venv" / ".pipemap-setup").is_file():
        return [Row("imports", "demo", "second scripts/demo.sh", float("nan"), None, "s", "< 20",
                    "skipped: run bash scripts/setup.sh first")]
    output = ctx.work / "demo.png"
    setup = timed(lambda: subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, check=True))
    demo = timed(lambda: subprocess.run(["bash", "scripts/demo.sh", "--output", str(output)], cwd=REPO, env=env,
                                        check=True, capture_output=True))
    ctx.summary["demo_second_s"] = f"{demo:.1f}"
    return [Row("imports", "demo", "setup.sh, already set up", setup, None, "s", "< 1"),
            Row("imports", "demo", "second scripts/demo.sh, whole", demo, None, "s", "< 20",
                "setup skipped; builds, plans, loads and runs the tiny pipeline twice")]
# ---- section: speed from a second device ---------------------------------------------------------------------------


def bench_parallel(ctx: Context) -> list[Row]:
    """run_many against one-by-one calls (images/s), and replicas against one device (seconds per image)."""
    import torch
    from diffusers import DiffusionPipeline

    with quiet():
        pipe = DiffusionPipeline.from_pretrained(ctx.folder("sd", ctx.scale))
    pipe.set_progress_bar_config(disable=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [overlap_row(pipe, ctx), *replica_rows(pipe, ctx)]
    finally:
        torch.set_num_threads(threads)
    ctx.summary["run_many_speedup"] = f"{rows[0].ratio:.2f}"
    ctx.summary["replicas_speedup"] = f"{1 / rows[1].ratio:.2f}"
    return rows


def speed_calls(pipe, n: int) -> list[dict]:
    import torch

    from pipemap import tiny

    return [dict(tiny.default_call(pipe, "sd"), prompt=f"a tiny cat number {i}",
                 generator=torch.Generator().manual_seed(i)) for i in range(n)]


def overlap_row(pipe, ctx: Context) -> Row:
    """Images per second of ``run_many`` (2 workers) and of a loop over the same calls, interleaved repeats."""
    import numpy as np

    import pipemap

    plan = pipemap.plan(pipe, hardware="2x24GiB")
    stages = {plan.device_map["unet"]} ^ {plan.device_map["text_encoder"], plan.device_map["vae"]}
    if len(stages) != 2:
        raise RuntimeError(f"not a 2-stage layout: {plan.device_map}")
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    n, repeats = (4, 3) if ctx.quick else (8, 5)
    many = lambda: [o.images for o in pipemap.run_many(pipe, speed_calls(pipe, n), workers=2)]  # noqa: E731
    one = lambda: [pipe(**call).images for call in speed_calls(pipe, n)]  # noqa: E731
    if not all(np.array_equal(a, b) for a, b in zip(many(), one(), strict=True)):  # also warms both
        raise RuntimeError("run_many's images differ from the one-by-one calls'")
    times: dict[str, list[float]] = {"many": [], "one": []}
    for i in range(repeats):
        for name in ("many", "one") if i % 2 == 0 else ("one", "many"):
            times[name].append(timed(many if name == "many" else one))
    pipemap.reset(pipe)
    ours, peer = (n / statistics.median(times[k]) for k in ("many", "one"))
    return Row("parallel", f"sd x{ctx.scale}", "run_many (2 workers) / one by one, 2-stage layout", ours, peer,
               "images/s", ">= 1 (higher is better)", f"{n} calls, n={repeats}; te+vae | unet, each stage locked")


def replica_rows(pipe, ctx: Context) -> list[Row]:
    """Seconds per image with the unet's batch (guidance: 2) split over two copies on two threads, against one
    device at 1 and at 2 intra-op threads."""
    import torch

    import pipemap

    on_cpu = {"cuda:0": "cpu", "cuda:1": "cpu"}
    plans = {"replicas": pipemap.plan(pipe, hardware="2x24GiB", strategy="parallel").remap(on_cpu),
             "one": pipemap.plan(pipe, hardware=CPU_HARDWARE), "one x2": pipemap.plan(pipe, hardware=CPU_HARDWARE)}
    if plans["replicas"].placement("unet").mode != "replicated":
        raise RuntimeError(f"no replicas: {plans['replicas'].notes}")
    repeats = 3 if ctx.quick else 6
    times: dict[str, list[float]] = {name: [] for name in plans}
    names = list(plans)
    for i in range(repeats + 1):  # the first round warms each variant and is not kept
        for name in names[i % 3:] + names[: i % 3]:
            pipemap.dispatch(pipe, plans[name])
            torch.set_num_threads(2 if name == "one x2" else 1)
            took = timed(lambda: pipe(**speed_calls(pipe, 1)[0]))
            torch.set_num_threads(1)
            pipemap.reset(pipe)
            if i:
                times[name].append(took)
    ours = statistics.median(times["replicas"])
    return [Row("parallel", f"sd x{ctx.scale}", f"replicas (2 copies, 2 threads) / {peer}", ours,
                statistics.median(times[key]), "s/image", "< 1" if key == "one" else "", f"n={repeats}")
            for key, peer in (("one", "one device, 1 thread"), ("one x2", "one device, 2 intra-op threads"))]


# ---- running, printing, recording ----------------------------------------------------------------------------------


SECTIONS: dict[str, Callable[[Context], list[Row]]] = {
    "plan": bench_plan, "hooks": bench_hooks, "load": bench_load, "offload": bench_offload, "catalog": bench_catalog,
    "dry_run": bench_dry_run, "imports": bench_imports, "parallel": bench_parallel, "ram": bench_ram,
}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class quiet:
    """Silence diffusers/transformers logging and progress bars (they would swamp the table)."""

    def __enter__(self):
        from diffusers.utils import logging as dlog
        from transformers.utils import logging as tlog

        self.levels = dlog.get_verbosity(), tlog.get_verbosity()
        dlog.set_verbosity_error()
        tlog.set_verbosity_error()
        dlog.disable_progress_bar()
        tlog.disable_progress_bar()

    def __exit__(self, *exc):
        from diffusers.utils import logging as dlog
        from transformers.utils import logging as tlog

        dlog.set_verbosity(self.levels[0])
        tlog.set_verbosity(self.levels[1])


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return ""
    if unit == "B":
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def table(rows: list[Row]):
    from rich.table import Table

    out = Table(title="pipemap CPU bench")
    for column in ("section", "pipeline", "metric", "pipemap", "peer", "unit", "ratio", "target", "note"):
        out.add_column(column, justify="right" if column in ("pipemap", "peer", "ratio") else "left")
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.4f}" if r.ratio < 0.01 else f"{r.ratio:.3f}"
        out.add_row(r.section, r.pipeline, r.metric, fmt(r.ours, r.unit), fmt(r.peer, r.unit), r.unit, ratio,
                    r.target, r.note)
    return out


def machine() -> str:
    model = platform.processor() or "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    cores = len(os.sched_getaffinity(0))
    return f"{model}, {cores} cores usable ({os.cpu_count()} online), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"


def versions() -> str:
    import diffusers
    import torch
    import transformers

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()

    rev, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    commit = rev + ("+dirty src" if dirty else "") + (" (bench/ uncommitted)" if git("status", "--porcelain", "--",
                                                                                        "bench") else "")
    return (f"torch {torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}, "
            f"python {platform.python_version()}, git {commit}")


def record(rows: list[Row], summary: str, args: argparse.Namespace, took: dict[str, float], started: str) -> None:
    """Append the run to bench/RESULTS.md as a markdown section; ``started`` is ``versions()`` at the start (the
    commit that ran), and a commit made meanwhile is named too."""
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    now = versions()
    lines = [f"\n## {stamp} — `bench/cpu.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"- machine: {machine()}", f"- versions: {started}" + ("" if now == started else f"; at the end: {now}"),
             f"- mid-size: sd x{args.scale}; repeats {args.repeats} (hooks), {args.load_repeats} processes x "
             f"(1 + {args.warm_loads} loads + {args.warm_loads} pairs) (load)",
             "- took: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()), "",
             "| section | pipeline | metric | pipemap | peer | unit | ratio | target | note |",
             "| --- | --- | --- | ---: | ---: | --- | ---: | --- | --- |"]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.4f}" if r.ratio < 0.01 else f"{r.ratio:.3f}"
        lines.append(f"| {r.section} | {r.pipeline} | {r.metric} | {fmt(r.ours, r.unit)} | {fmt(r.peer, r.unit)} "
                     f"| {r.unit} | {ratio} | {r.target} | {r.note} |")
    lines += ["", "```", summary, "```", ""]
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller mid-size pipeline and fewer repeats (< 60 s)")
    parser.add_argument("--scale", type=int, help="mid-size pipeline scale (default 12, or 6 with --quick)")
    parser.add_argument("--repeats", type=int, help="calls per variant in the hook section, a multiple of 3 "
                        "(default 15, quick 6)")
    parser.add_argument("--load-repeats", type=int, help="child processes per loader (default 5, quick 2)")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    parser.add_argument("--warm-loads", type=int, help="loads per child after the first, timed (default 4, quick 2)")
    parser.add_argument("--child-load", nargs=2, metavar=("LOADER", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--child-ram", nargs=4, metavar=("LOADER", "FOLDER", "PLAN", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.scale = args.scale or (6 if args.quick else 12)
    args.repeats = args.repeats or (6 if args.quick else 15)
    args.load_repeats = args.load_repeats or (2 if args.quick else 5)
    args.warm_loads = args.warm_loads if args.warm_loads is not None else (2 if args.quick else 4)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child_load:
        child_main(*args.child_load, args.warm_loads)
        return
    if args.child_ram:
        child_ram_main(*args.child_ram)
        return
    from rich.console import Console

    console = Console(width=max(Console().width, 150))
    started = versions()
    start = time.perf_counter()
    rows: list[Row] = []
    took: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="pipemap-bench-") as work:
        ctx = Context(args.quick, args.scale, args.repeats, args.load_repeats, args.warm_loads, Path(work))
        for name in args.only or SECTIONS:
            with console.status(f"bench: {name}"):
                begin = time.perf_counter()
                rows += SECTIONS[name](ctx)
                took[name] = time.perf_counter() - begin
    seconds = time.perf_counter() - start
    took["total"] = seconds
    console.print(table(rows))
    summary = "summary: " + " ".join(f"{k}={v}" for k, v in ctx.summary.items())
    if not args.no_record:
        record(rows, summary, args, took, started)
    console.print("took " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items())
                  + ("" if args.no_record else f"; appended to {RESULTS}"))
    print(summary)


if __name__ == "__main__":
    main()
