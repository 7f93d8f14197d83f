"""A transformer pipeline (tiny Flux-like: CLIP and T5 encoders, flow matching): every strategy on stand-in GPUs,
and every strategy remapped onto the CPU equals plain diffusers."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import plain_pipeline, run
from pipemap import tiny
from pipemap.planner import MIXED, STRATEGIES

# tiny Flux-like: transformer 0.74 MiB, T5 0.25, CLIP 0.22, vae 1.06 (fp32)
MACHINES = ("3x1MiB,cpu=1GiB", "2x0.9MiB,cpu=1GiB", "1x1.2MiB,cpu=1GiB")
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu", "cuda:2": "cpu"}


@pytest.fixture(scope="module")
def flux(flux_folder):
    pipe = plain_pipeline(flux_folder)
    return flux_folder, pipe, run(pipe, "flux")


def _plans(folder: str):
    """Every strategy's plan on every machine, each distinct placement once (auto repeats the one it picks)."""
    seen = set()
    for machine in MACHINES:
        for strategy in (*STRATEGIES, *MIXED, "auto"):
            try:
                plan = pipemap.plan(folder, hardware=machine, strategy=strategy, headroom=0.0)
            except pipemap.DoesNotFitError:
                continue
            if plan.components not in seen:
                seen.add(plan.components)
                yield plan


def test_header_bytes_equal_loaded_bytes_with_t5(flux):
    folder, pipe, _ = flux
    loaded = {n: pipemap.inventory.module_bytes(m) for n, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    assert {c.name: c.bytes for c in pipemap.inspect(folder).models} == loaded


@pytest.mark.slow
def test_every_strategy_runs_clean_on_stand_in_gpus(flux):
    folder, _, _ = flux
    modes = set()
    for plan in _plans(folder):
        report = pipemap.simulate(folder, plan, **_call())
        assert report.ok, (plan.strategy, report.error)
        modes |= {p.mode for p in plan.components}
    assert {"resident", "offload", "stream"} <= modes


def test_every_strategy_on_the_cpu_equals_plain(flux):
    folder, _, reference = flux
    for plan in _plans(folder):
        pipe = pipemap.load(folder, plan=plan.remap(ON_CPU), progress=False)
        torch.testing.assert_close(run(pipe, "flux"), reference, atol=1e-5, rtol=0)
        pipemap.reset(pipe)


def _call() -> dict:
    return {"height": 32, "width": 32, "max_sequence_length": tiny.FLUX_TOKENS}


def test_t5_keeps_its_fp32_modules_at_fp16(flux):
    # transformers keeps T5's "wo" projections in float32 when float16 is asked for; the headers must say so
    folder, _, _ = flux
    pipe = plain_pipeline(folder, dtype=torch.float16)
    assert pipe.text_encoder_2.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    loaded = pipemap.inventory.module_bytes(pipe.text_encoder_2)
    assert pipemap.inspect(folder, dtype=torch.float16)["text_encoder_2"].bytes == loaded
