"""IP-Adapter, fused QKV projections, FreeU, ``load_state_dict`` and components swapped on a placed pipeline, under each
strategy on two GPUs remapped onto the CPU, against the same operation on plain diffusers; after each, every tensor of
every component where its placement keeps it (``everyday.strays``)."""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusionImg2ImgPipeline

import pipemap
from everyday import (
    ON_CPU,
    STRATEGIES,
    images,
    ip_image,
    load_ip_adapter,
    placed,
    plain,
    save_ip_adapter,
    strays,
)
from helpers import models_of


@pytest.fixture(scope="module")
def ip_adapter(tmp_path_factory) -> str:
    return save_ip_adapter(plain("sd"), tmp_path_factory.mktemp("ip_adapter"))


def _nudged(state: dict[str, torch.Tensor], seed: int = 9) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
            for k, v in state.items()}


def _operations(ip_folder: str, kind: str):
    """(name, operation, extra call arguments): what users do to a loaded pipeline's models."""
    def denoiser(p):
        return p.transformer if kind == "flux" else p.unet

    state = _nudged(denoiser(plain(kind)).state_dict())
    image = {"ip_adapter_image": ip_image()}
    sd = [
        ("load_ip_adapter", lambda p: (load_ip_adapter(p, ip_folder), p.set_ip_adapter_scale(0.7)), image),
        ("set_ip_adapter_scale", lambda p: p.set_ip_adapter_scale(0.3), image),
        ("unload_ip_adapter", lambda p: p.unload_ip_adapter(), {}),
        ("enable_freeu", lambda p: p.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4), {}),
        ("disable_freeu", lambda p: p.disable_freeu(), {}),
    ] if kind == "sd" else []
    return [*sd,
            ("fuse_qkv_projections", lambda p: denoiser(p).fuse_qkv_projections(), {}),
            ("unfuse_qkv_projections", lambda p: denoiser(p).unfuse_qkv_projections(), {}),
            ("load_state_dict", lambda p: denoiser(p).load_state_dict(state, strict=False), {})]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["sd", "flux"])
def test_adapters_and_model_edits_follow(ip_adapter, kind, strategy):
    if kind == "flux" and strategy == "parallel":
        pytest.skip("Flux gets no replicas: its parallel plan is balanced's")
    pipe, _ = placed(kind, strategy)
    reference = plain(kind)
    for name, operation, extra in _operations(ip_adapter, kind):
        operation(reference)
        operation(pipe)
        torch.testing.assert_close(images(pipe, kind, **extra), images(reference, kind, **extra), atol=1e-5, rtol=0,
                                   msg=name)
        assert strays(pipe) == [], name
    pipemap.reset(pipe)
    torch.testing.assert_close(images(pipe, kind), images(reference, kind), atol=1e-5, rtol=0)


def test_an_ip_adapter_image_encoder_is_placed_and_its_removal_unplaces_it(ip_adapter):
    pipe, plan = placed("sd", "balanced")
    load_ip_adapter(pipe, ip_adapter)
    assert "image_encoder" not in pipe.hf_device_map
    images(pipe, "sd", ip_adapter_image=ip_image())
    assert pipe.hf_device_map["image_encoder"] == "cpu"  # the device with the most room left, remapped
    pipe.unload_ip_adapter()
    assert "image_encoder" not in pipe.hf_device_map and pipe.image_encoder is None


# ---- components swapped -----------------------------------------------------------------------------------------


def _other_unet(seed: int = 4):
    unet = plain("sd").unet
    unet.load_state_dict(_nudged(unet.state_dict(), seed))
    return unet


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_component_assigned_is_placed_as_the_old_one_was(strategy):
    pipe, plan = placed("sd", strategy)
    reference = plain("sd")
    reference.unet = _other_unet()
    old, new = pipe.unet, _other_unet()
    kind_of_hook = type(old._hf_hook)
    pipe.unet = new
    assert pipe.unet is new and type(new._hf_hook) is kind_of_hook and not hasattr(old, "_hf_hook")
    assert all(p.device.type == "cpu" for p in old.parameters())
    torch.testing.assert_close(images(pipe, "sd"), images(reference, "sd"), atol=1e-5, rtol=0)
    assert strays(pipe) == []
    assert pipe.hf_device_map == plan.remap(ON_CPU).device_map
    pipemap.reset(pipe)
    assert not hasattr(new, "_hf_hook") and all(p.device.type == "cpu" for p in new.parameters())


def test_a_component_that_does_not_fit_its_placement_is_refused_and_nothing_changes():
    pipe, plan = placed("sd", "balanced_low_memory")  # the unet offloaded: onloaded within its room
    old = pipe.unet
    with pytest.raises(pipemap.ComponentChangedError, match=r"pipemap.reset\(pipe\)") as caught:
        pipe.unet = torch.nn.Linear(2000, 2000)
    assert caught.value.component == "unet" and isinstance(caught.value, ValueError)
    assert pipe.unet is old and strays(pipe) == [] and pipe.hf_device_map == plan.remap(ON_CPU).device_map
    with pytest.raises(pipemap.ComponentChangedError, match="not a component pipemap placed"):
        pipemap.replace(pipe, "tokenizer", None)


def test_remove_all_hooks_and_reset_of_a_from_pipe_copy_undo_everything():
    pipe, plan = placed("sd", "balanced_ultra_low_memory")
    pipe.remove_all_hooks()  # diffusers' own undo: a full reset, never half
    assert pipe.hf_device_map is None
    assert not any(hasattr(m, "_hf_hook") for m in models_of(pipe).values())
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    copy_ = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
    pipemap.reset(copy_)  # the copy shares the placed models: the pipeline they were placed for is reset too
    assert pipe.hf_device_map is None and "_pipemap" not in pipe.__dict__
    assert not any(hasattr(m, "_hf_hook") for m in models_of(pipe).values())
    pipe.to("cpu")  # no longer refused
    pipemap.dispatch(pipe, plan.remap(ON_CPU))  # and it can be placed again
    want = images(plain("sd"), "sd")
    torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-5, rtol=0)
