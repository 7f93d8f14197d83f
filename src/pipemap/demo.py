"""``pipemap demo``: the embedded tiny pipeline, built in code, planned, loaded, run and checked."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from . import tiny
from .api import Request, load, runnable
from .dispatch import planned, stats
from .quiet import quiet_progress


def run_demo(folder: Path, hardware: str | None, strategy, output: Path) -> int:
    """Build the tiny Stable Diffusion pipeline, plan it for this machine (or ``hardware``), load it through
    ``pipemap.load``, generate one image, save it as PNG, and print the plan and the largest difference from an
    un-mapped run."""
    with quiet_progress():
        path = tiny.save("sd", folder / "tiny-sd")
    print(f"built the tiny Stable Diffusion pipeline in code and saved it to {path}")
    pipe = _load_here(path, Request.of(str(path), hardware, strategy).plan())
    image = _generate(pipe)
    plan = planned(pipe)
    assert plan is not None  # pipemap.load dispatched it
    device = plan.execution_device
    with quiet_progress():
        plain = DiffusionPipeline.from_pretrained(path).to(device)  # the same device: the same kernels
    difference = float(np.abs(image - _generate(plain)).max())
    _save_png(image, output)
    print(f"saved {output} ({image.shape[1]}x{image.shape[0]}); largest difference from an un-mapped run: "
          f"{difference:.3g} (that run on {device})")
    return 0 if difference <= _tolerance(device) else 1


def _tolerance(device: str) -> float:
    # on a GPU, components on other GPUs may pick other convolution algorithms (TF32 among them): about 1e-3
    return 1e-5 if device == "cpu" else 2e-3


def generate(request: Request, prompt: str, seed: int, options: dict, output: Path) -> int:
    """``pipemap run``: plan a folder as ``request`` asks, load it onto the plan, generate one image from ``prompt``
    with the call ``options`` and save it; prints the plan, the time and, for offloaded components, the bytes moved."""
    pipe = _load_here(request.source, request.plan())
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    image = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **options).images[0]
    print(f"generated in {time.perf_counter() - start:.2f} s")
    for component, moved in stats(pipe).items():
        print(f"{component}: {moved['calls']} calls, {moved['h2d_bytes']} bytes moved to its GPU")
    _save_png(image, output)
    print(f"saved {output} ({image.shape[1]}x{image.shape[0]})")
    return 0


def _load_here(path, plan):
    """Print the plan and load onto it; devices this machine lacks are replaced by the CPU, and it says so."""
    print(plan)
    running = runnable(plan)
    if running != plan:
        print("this machine lacks some planned devices: running the same plan with them on the CPU")
    return load(path, plan=running)


def _generate(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(**tiny.default_call(pipe, "sd", output_type="np")).images[0]


def _save_png(image: np.ndarray, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((np.clip(image, 0, 1) * 255).round().astype("uint8")).save(output)


