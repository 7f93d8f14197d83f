"""What many test files share: plain pipelines to compare with, the command line (in this process or a child), tiny
inventories and random planning problems. Fixtures live in ``conftest.py``; this is plain code, imported by name
(``tests`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import time
import warnings

import torch
from diffusers import DiffusionPipeline
from hypothesis import strategies as st

import pipemap
from pipemap import Component, Hardware, Inventory, Plan, granularity, tiny
from pipemap.plan import Placement


def plain_pipeline(folder: str, **kwargs):
    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, kind: str) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return torch.as_tensor(pipe(**tiny.default_call(pipe, kind)).images)


def pipemap_cli(*args: str, cwd=None, child: bool = False) -> subprocess.CompletedProcess:
    """``pipemap *args``: by default in this process, through ``pipemap.cli.main`` (what ``python -m pipemap`` runs)
    with its output captured and the environment, warning filters and working directory it touches restored, which
    spares each call a new interpreter's import of torch and diffusers; with ``child=True`` in a child process, as a
    user runs it."""
    if child:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "pipemap", *args], capture_output=True, text=True, env=env,
                              cwd=cwd, timeout=300)
    from pipemap.cli import main

    out, err, environ, here = io.StringIO(), io.StringIO(), dict(os.environ), os.getcwd()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse's answer to bad arguments
                code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["pipemap", *args], code, out.getvalue(), err.getvalue())


# How far a computation cut into parts may stray from the whole one. The CPU's matrix library (oneDNN, MKL) picks
# its kernel by the shape and the instruction set: a 1-row slice of a matmul sums in another order than 5 rows do on
# an AVX-512/AMX CPU (1 ulp, 5.96e-8 in float32), so outputs compared across batch shapes, token shards or devices are
# never exactly equal on every machine. A tolerance is a number of the dtype's ulps (``torch.finfo(dtype).eps``) per
# operation, both absolute (values near 1) and relative: one layer rounds its output once or twice; attention in
# shards sums its softmax in another order; a pipeline's denoising loop carries each step's rounding into the next.
SPLIT_ULPS = {"layer": 8, "attention": 1024, "pipeline": 128}


def split_tolerance(dtype: torch.dtype = torch.float32, operation: str = "layer") -> dict[str, float]:
    """``{"atol", "rtol"}`` for ``torch.testing.assert_close`` of a split computation against the whole one."""
    ulps = torch.finfo(dtype).eps * SPLIT_ULPS[operation]
    return {"atol": ulps, "rtol": ulps}


def assert_split_close(got, want, operation: str = "layer") -> None:
    """``got``, computed in parts (a batch cut across copies, tokens across shards), close to ``want``, computed
    whole, within ``split_tolerance`` of ``want``'s dtype: never exact equality across batch shapes."""
    dtype = want.dtype if isinstance(want, torch.Tensor) else torch.float32
    torch.testing.assert_close(got, want, **split_tolerance(dtype, operation))


def inventory(*sizes: tuple[str, int], dtype: str | None = None) -> Inventory:
    """An inventory of models with these ``(name, bytes)`` in pipeline order, plus two weightless parts."""
    models = tuple(Component(name, "diffusers", "Model", size, True) for name, size in sizes)
    weightless = (Component("tokenizer", "transformers", "CLIPTokenizer"),
                  Component("scheduler", "diffusers", "DDIMScheduler"))
    return Inventory("test", "TestPipeline", weightless[:1] + models + weightless[1:], dtype)


def plan(inv, hardware, **kwargs) -> Plan:
    kwargs.setdefault("headroom", 0.0)
    return pipemap.plan(inv, hardware=Hardware.parse(hardware), **kwargs)


NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "controlnet", "unet", "transformer",
         "vae")


@st.composite
def problems(draw):
    """An inventory of 1..8 components with sizes, and a profile of 1..4 GPUs with byte budgets."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8, unique=True))
    sizes = [draw(st.integers(0, 1000)) for _ in names]
    budgets_ = draw(st.lists(st.integers(0, 2000), min_size=1, max_size=4))
    hardware = ",".join(f"cuda:{i}={b}" for i, b in enumerate(budgets_)) + ",cpu=100000"
    return inventory(*zip(names, sizes)), hardware


def models_of(pipe) -> dict[str, torch.nn.Module]:
    """The pipeline's components that are torch modules, by name."""
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def pipeline_state(pipe) -> dict:
    """Everything dispatch may touch: devices, tensor identities (buffers too), hooks, instance attributes."""
    return {
        name: (sorted(module.__dict__), [(id(p), p.device, p.is_pinned()) for p in module.parameters()],
               [id(b) for b in module.buffers()], [m for m in module.modules() if hasattr(m, "_hf_hook")],
               [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in module.modules()])
        for name, module in models_of(pipe).items()
    } | {"pipe": sorted(k for k in pipe.__dict__ if not k.startswith("_") or k.startswith("_pipemap")),
         "map": pipe.hf_device_map}  # a pipeline call sets _guidance_scale and the like on the pipe


def moving(base: Plan, inv: Inventory, modes: dict[str, tuple[str, str]]) -> Plan:
    """``base`` with the components of ``modes`` moved: ``{name: (mode, execution GPU)}``; streamed ones cut as
    finely as the planner can (their charge: ``granularity.cut`` at the inventory's bytes in flight), offloaded
    ones with the component's bytes as room. ``inv``: the inventory ``base`` was planned from."""
    found_in = {c.name: c for c in inv.models}
    parts = []
    for p in base.components:
        if p.component in modes:
            mode, gpu = modes[p.component]
            if mode == "stream":  # its pieces as the planner lays them out at the fewest bytes it can stream in
                found = granularity.cut(found_in[p.component].tree, found_in[p.component].in_flight)
                p = Placement(p.component, "cpu", p.bytes, mode, gpu, found.in_flight, (), found.blocks,
                              found.resident, found.resident_bytes, found.prefetch, found.level)
            else:
                p = Placement(p.component, "cpu", p.bytes, mode, gpu, found_in[p.component].bytes)
        parts.append(p)
    return dataclasses.replace(base, components=tuple(parts))


def replica_inventory(pipeline_class: str) -> Inventory:
    """Text encoder 2 GiB, transformer 10 GiB, vae 1 GiB, in bfloat16, of ``pipeline_class``."""
    gib = 2**30
    models = (Component("text_encoder", "transformers", "CLIPTextModel", 2 * gib, True),
              Component("transformer", "diffusers", "Model", 10 * gib, True),
              Component("vae", "diffusers", "AutoencoderKL", gib, True))
    return Inventory("test", pipeline_class, models, "bfloat16")


def with_copy(pipe, mode: str, component: str = "transformer", hardware: str = "2x64MiB,cpu=1GiB",
              copies: int = 1) -> Plan:
    """Every component of ``pipe`` on cuda:0, ``component`` with a copy on each of cuda:1.. in ``mode``
    (``"guidance"``, ``"sequence"``, ``"replicated"``): the other GPUs hold nothing else, so what they compute is
    the copies'."""
    plan_ = pipemap.plan(pipe, hardware=hardware, strategy=dict.fromkeys(models_of(pipe), "cuda:0"), headroom=0.0)
    size, gpus = plan_.placement(component).bytes, tuple(f"cuda:{i}" for i in range(1, 1 + copies))
    parts = tuple(dataclasses.replace(p, mode=mode, replicas=gpus) if p.component == component else p
                  for p in plan_.components)
    devices = tuple(dataclasses.replace(d, used=d.used + size) if d.device in gpus else d for d in plan_.devices)
    return dataclasses.replace(plan_, strategy="parallel", components=parts, devices=devices)


def processes_gone(pids: list[int], within_s: float = 10) -> bool:
    """Whether every process of ``pids`` has exited (or is a zombie its parent has not reaped) within ``within_s``."""
    import psutil

    deadline = time.monotonic() + within_s
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
