"""``pipemap demo`` and ``pipemap run`` (``pipemap.demo``): a plan for devices this machine lacks runs with them on the
CPU (``api.runnable``), and one image is generated from a ``Request`` and saved."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import pipemap
from helpers import inventory, plain_pipeline
from pipemap import demo
from pipemap.api import Request, runnable
from pipemap.hardware import Hardware

SDXL_LIKE = inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20))


@pytest.fixture
def machine(monkeypatch):
    """This machine, as ``Hardware.detect`` sees it, made what the test says (CPU only unless told)."""

    def make(spec: str = "cpu=1GiB") -> None:
        monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls, reserve=0: Hardware.parse(spec)))
        # the GPUs alone, as ``runnable`` asks for them
        monkeypatch.setattr(pipemap.api, "gpu_names", lambda: [n for n in Hardware.parse(spec).names if n != "cpu"])

    make()
    return make


def test_runnable_puts_the_devices_this_machine_lacks_on_the_cpu(machine):
    plan = pipemap.plan(SDXL_LIKE, hardware="cuda:0=100,cuda:1=100,cpu=1000", strategy="balanced_low_memory",
                        headroom=0.0)
    here = runnable(plan)
    assert here == plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"})
    assert {p.device for p in here.components} == {"cpu"} and here.execution_device == "cpu"
    assert [p.mode for p in here.components] == [p.mode for p in plan.components]  # the same plan, on the CPU
    machine("cuda:0=1GiB,cpu=1GiB")  # one of the two GPUs here: only the other moves
    assert runnable(plan) == plan.remap({"cuda:1": "cpu"})


def test_runnable_leaves_a_plan_this_machine_can_run_as_it_is(machine):
    plan = pipemap.plan(SDXL_LIKE, hardware="cpu=1000")
    assert runnable(plan) is plan


def test_generate_writes_the_image_a_plain_run_makes(tiny_folders, tmp_path, capsys, machine):
    request = Request.of(tiny_folders["sd"], hardware="2x5MiB,cpu=1GiB")
    output = tmp_path / "out" / "cat.png"  # its folder made too
    assert demo.generate(request, "a tiny cat", 3, {"num_inference_steps": 2}, output) == 0
    printed = capsys.readouterr().out
    assert "this machine lacks some planned devices" in printed and f"saved {output} (32x32)" in printed
    assert "unet: 2 calls" in printed  # two steps, guidance in one batch
    saved = np.asarray(Image.open(output).convert("RGB"), dtype=np.int16)
    plain = plain_pipeline(tiny_folders["sd"])(
        "a tiny cat", generator=torch.Generator("cpu").manual_seed(3), output_type="np", num_inference_steps=2)
    expected = (np.clip(plain.images[0], 0, 1) * 255).round().astype(np.int16)
    assert saved.shape == (32, 32, 3) and np.abs(saved - expected).max() <= 1
