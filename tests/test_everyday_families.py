"""A LoRA added after placing, across the pipeline families of ``tests/families.py`` (diffusers' own fast-test
components): each family's denoiser streamed block by block from a plan on two GPUs remapped onto the CPU, a random
LoRA added to it with peft after dispatch, the output against the same LoRA on plain diffusers."""

from __future__ import annotations

import pytest
import torch

import families
import pipemap
from everyday import ON_CPU, strays, two_gpu_plan
from pipemap.inventory import DENOISERS


def _with_lora(denoiser: torch.nn.Module) -> bool:
    """A random LoRA (seeded) on the denoiser's first eight linear layers; False if it takes none."""
    from peft import LoraConfig

    names = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)][:8]
    if not hasattr(denoiser, "add_adapter") or not names:
        return False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        denoiser.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=names, init_lora_weights=False))
    return True


def _denoiser(pipe) -> str | None:
    return next((n for n in DENOISERS if isinstance(pipe.components.get(n), torch.nn.Module)), None)


def _run(pipe, kwargs) -> torch.Tensor:
    out = pipe(**kwargs)
    images = getattr(out, "images", None)
    return torch.as_tensor(images if images is not None else out.frames)


@pytest.mark.slow
@pytest.mark.parametrize("family", families.FAMILIES)
def test_a_lora_added_after_placing_is_streamed_with_its_denoiser(family):
    reference, kwargs = families.build(family)
    name = _denoiser(reference)
    if name is None or not _with_lora(getattr(reference, name)):
        pytest.skip(f"{family}: no denoiser that takes a peft adapter")
    want = _run(reference, dict(kwargs))
    pipe, kwargs = families.build(family)
    plan = two_gpu_plan(pipe, "balanced_ultra_low_memory")
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    _with_lora(getattr(pipe, name))
    torch.testing.assert_close(_run(pipe, dict(kwargs)), want, atol=1e-5, rtol=0)
    assert strays(pipe) == []
    pipemap.reset(pipe)
