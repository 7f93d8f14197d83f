"""Tiny pipelines loaded onto plans for real GPUs, run under the fake CUDA (tests/fakecuda.py): every CUDA branch of
placing and running (the transfer check, pinned packed groups, ``CudaQueues``, the offload, stream, split and replica
hooks) runs as on a GPU, each copy and read checked for ordering (the fixture fails a test on any race), the output
equal to plain diffusers', and nothing left on the GPUs or pinned after ``reset``."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import fakecuda
import pipemap
from helpers import plain_pipeline, run
from pipemap import tiny
from pipemap.planner import forcing_hardware

# tiny models: unet 3.0 MiB, vae 2.5, controlnet 1.6, text encoders 0.2 (the split GPUs fit neither unet nor vae)
CASES = {
    "offload": ("sd", "balanced_low_memory", None),
    "stream": ("sdxl", "balanced_ultra_low_memory", None),
    "stream-flux": ("flux", "balanced_ultra_low_memory", None),
    "split": ("sd", "balanced_split", "3x2.4MiB,cpu=1GiB"),
    "replicas": ("sd", "parallel", "2x8MiB,cpu=1GiB"),
    "auto": ("controlnet", "auto", None),
}
MODE = {"offload": "offload", "stream": "stream", "stream-flux": "stream", "split": "split", "replicas": "replicated"}


@pytest.fixture(scope="module")
def folders(tiny_folders, tmp_path_factory) -> dict[str, str]:
    return {**tiny_folders, "flux": str(tiny.save("flux", tmp_path_factory.mktemp("flux") / "flux"))}


@pytest.fixture(scope="module")
def references(folders, reference_outputs) -> dict[str, torch.Tensor]:
    return {**reference_outputs, "flux": run(plain_pipeline(folders["flux"]), "flux")}


def _plan(folder: str, strategy: str, hardware: str | None):
    gpus = 1 if strategy == "balanced_low_memory" else 2  # two GPUs leave nothing to offload on tiny sd
    hardware = hardware or forcing_hardware(pipemap.inspect(folder), strategy, gpus=gpus)
    return pipemap.plan(folder, hardware=hardware, strategy=strategy, headroom=0.0)


def _released(fake_cuda, pipe) -> None:
    """After reset, nothing of the pipeline on the GPUs (but the scheduler's timesteps) and nothing pinned."""
    pipemap.reset(pipe)
    schedule = sum(t.numel() * t.element_size() for t in vars(pipe.scheduler).values() if fakecuda.on_device(t))
    del pipe
    gc.collect()
    assert sum(fake_cuda.allocated.values()) <= schedule + 4096 and not fake_cuda.registered


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_pipeline_on_fake_gpus_equals_plain(fake_cuda, folders, references, case):
    kind, strategy, hardware = CASES[case]
    fake_cuda.gpus = 3
    plan = _plan(folders[kind], strategy, hardware)
    assert case not in MODE or any(p.mode == MODE[case] for p in plan.components), plan
    pipe = pipemap.load(folders[kind], plan=plan, progress=False)  # the transfer check runs on the fake GPUs
    # loaded onto a GPU, yet not kernelized from the Hub (transformers 5.25's default): plain diffusers is not
    assert not any(getattr(m, "use_kernels", False) for m in pipe.components.values()), plan
    for _ in range(2):
        torch.testing.assert_close(run(pipe, kind), references[kind], atol=1e-5, rtol=0)
    _released(fake_cuda, pipe)


@pytest.mark.slow
@pytest.mark.parametrize(("depth", "resident"), [(1, False), (2, True), (3, True)])
def test_streamed_denoiser_at_each_depth_with_resident_pieces(fake_cuda, folders, references, depth, resident):
    plan = _plan(folders["sd"], "balanced_ultra_low_memory", None)
    unet = plan.placement("unet")
    assert unet.mode == "stream" and len(unet.blocks) > 3, unet
    kept = (unet.blocks[0][0], "") if resident else ()
    kept_bytes = unet.blocks[0][1] if resident else 0
    changed = dataclasses.replace(unet, prefetch=depth, resident_blocks=kept, resident_bytes=kept_bytes)
    plan = dataclasses.replace(plan, components=tuple(changed if p is unet else p for p in plan.components))
    pipe = pipemap.load(folders["sd"], plan=plan, progress=False)
    hook = pipe.unet._hf_hook
    for _ in range(2):
        torch.testing.assert_close(run(pipe, "sd"), references["sd"], atol=1e-5, rtol=0)
    assert hook.spec.depth == depth and len(hook.kept_buffers) == len(hook.kept) == (1 if resident else 0) + bool(
        resident and hook.root.slots)
    _released(fake_cuda, pipe)
