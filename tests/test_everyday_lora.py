"""LoRA on a placed pipeline (``hooks/changes.py``): load, switch, fuse, unfuse, unload, delete, under each strategy on
two GPUs remapped onto the CPU, each step against the same step on plain diffusers, and after each step every tensor
of every component where its placement keeps it (``everyday.strays``)."""

from __future__ import annotations

import pytest
import torch

import pipemap
from everyday import STRATEGIES, images, placed, plain, save_lora, strays


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, dict[str, str]]:
    """``{kind: {"a": folder, "b": folder}}``: two random LoRAs of each tiny denoiser (b on fewer layers)."""
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for kind in ("sd", "sdxl", "flux"):
        (root / kind / "a").mkdir(parents=True)
        (root / kind / "b").mkdir()
        out[kind] = {"a": save_lora(kind, root / kind / "a", seed=1),
                     "b": save_lora(kind, root / kind / "b", seed=2, targets=("to_q", "to_v"), rank=2)}
    return out


def _steps(folders: dict[str, str]):
    """(name, operation, tolerance): what a user does with LoRAs, in order."""
    return [
        ("load a", lambda p: p.load_lora_weights(folders["a"], adapter_name="a"), 1e-5),
        ("load b", lambda p: p.load_lora_weights(folders["b"], adapter_name="b"), 1e-5),
        ("set_adapters", lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5]), 1e-5),
        ("fuse", lambda p: p.fuse_lora(lora_scale=0.8), 1e-4),
        ("unfuse", lambda p: p.unfuse_lora(), 1e-4),
        ("disable", lambda p: p.disable_lora(), 1e-4),
        ("enable", lambda p: p.enable_lora(), 1e-4),
        ("delete b", lambda p: p.delete_adapters("b"), 1e-4),
        ("unload", lambda p: p.unload_lora_weights(), 1e-4),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["sd", "sdxl", "flux"])
def test_lora_follows_every_step(loras, kind, strategy):
    if kind == "flux" and strategy == "parallel":
        pytest.skip("Flux gets no replicas: its parallel plan is balanced's")
    pipe, _ = placed(kind, strategy)
    reference = plain(kind)
    previous = images(reference, kind)
    effects = []
    for name, operation, tolerance in _steps(loras[kind]):
        operation(reference)
        operation(pipe)
        want = images(reference, kind)
        torch.testing.assert_close(images(pipe, kind), want, atol=tolerance, rtol=0, msg=name)
        assert strays(pipe) == [], name
        effects.append((want - previous).abs().max().item())
        previous = want
    changed = dict(zip([name for name, _, _ in _steps(loras[kind])], effects))
    assert min(changed[n] for n in ("load a", "set_adapters", "fuse", "disable", "enable", "unload")) > 1e-3
    pipemap.reset(pipe)
    torch.testing.assert_close(images(pipe, kind), images(reference, kind), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_fused_lora_survives_eviction_and_reset(loras, strategy):
    # fuse_lora writes into the weights it finds: under offload and streaming those are the onloaded copies, which
    # eviction and reset drop; pipemap writes them back into the CPU masters first
    pipe, _ = placed("sd", strategy)
    reference = plain("sd")
    for p in (pipe, reference):
        p.load_lora_weights(loras["sd"]["a"], adapter_name="a")
        images(p, "sd")  # the denoiser onloaded (offload keeps it), the kept stream blocks onloaded
        p.fuse_lora()
        p.unload_lora_weights()  # the fused weights stay, the LoRA layers go
    want = images(reference, "sd")
    torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-4, rtol=0)
    assert strays(pipe) == []
    pipemap.reset(pipe)
    torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-4, rtol=0)
