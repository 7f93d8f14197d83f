"""What many test files share: plain pipelines to compare with, the command line in a child process, tiny
inventories and random planning problems. Fixtures live in ``conftest.py``; this is plain code, imported by name
(``tests`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from diffusers import DiffusionPipeline
from hypothesis import strategies as st

import pipemap
from pipemap import Component, Hardware, Inventory, Plan, tiny


def plain_pipeline(folder: str, **kwargs):
    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, kind: str) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return torch.as_tensor(pipe(**tiny.default_call(pipe, kind)).images)


def pipemap_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "pipemap", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


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
