"""Changes to a placed pipeline made where diffusers users make them (issue 39): during a call (from
``callback_on_step_end``), from another thread, through ``from_pipe``, by Ctrl-C; each against plain diffusers doing
the same, and after it every tensor where its placement keeps it (``everyday.strays``)."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

import pipemap
from everyday import ON_CPU, STRATEGIES, images, placed, plain, save_lora, strays, two_gpu_plan
from helpers import models_of
from pipemap import tiny
from pipemap.dispatch import planned
from pipemap.errors import PipelineMappedError, PlanMismatchError
from pipemap.hooks import changes
from pipemap.hooks.changes import unchanged
from pipemap.runtime.placed import placed as record_of


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for kind in ("sd", "sdxl", "flux"):
        (root / kind).mkdir()
        out[kind] = save_lora(kind, root / kind, seed=3)
    return out


def _denoiser(pipe) -> torch.nn.Module:
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def _at_step(step: int, change):
    """A ``callback_on_step_end`` that makes ``change(pipe)`` at the end of step ``step``."""
    def callback(pipe, index, timestep, tensors):
        if index == step:
            change(pipe)
        return {}

    return callback


def _both(pipe, reference, kind: str, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    return images(pipe, kind, **extra), images(reference, kind, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["sd", "sdxl", "flux"])
def test_a_lora_scale_set_from_a_step_callback_is_followed_in_that_call_and_after(loras, kind, strategy):
    # the "LoRA only for the first step" trick: under "parallel" the replica's copy must get the new scale before
    # the next step, and the end of the call must not record an unplaced change as placed
    pipe, _ = placed(kind, strategy)
    reference = plain(kind)
    for each in (pipe, reference):
        each.load_lora_weights(loras[kind], adapter_name="a")
    callback = _at_step(0, lambda p: p.set_adapters(["a"], [0.25]))
    got, want = _both(pipe, reference, kind, callback_on_step_end=callback)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(*_both(pipe, reference, kind), atol=1e-5, rtol=0)  # the next call: scale 0.25 kept
    assert strays(pipe) == []


def _freeu(pipe) -> None:
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)


def _scale_in_place(pipe) -> None:
    with torch.no_grad():
        pipe.unet.conv_in.weight.mul_(1.5)  # a weight written in place: its version counter moves


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_freeu_and_a_weight_scaled_in_place_from_callbacks_are_followed(strategy):
    pipe, _ = placed("sd", strategy)
    reference = plain("sd")
    for change in (_freeu, _scale_in_place):
        got, want = _both(pipe, reference, "sd", callback_on_step_end=_at_step(0, change))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(*_both(pipe, reference, "sd"), atol=1e-5, rtol=0)
        assert strays(pipe) == [], change.__name__


@pytest.mark.slow
def test_an_unchanged_pipeline_is_checked_without_hashing_its_models(monkeypatch):
    # following costs a sum of version counters a call (bench/follow_cost.py); the signature is taken only when the
    # change counter or a version moved, and then only of the model that changed
    pipe, _ = placed("sd", "parallel")
    images(pipe, "sd")
    assert all(unchanged(m) for m in models_of(pipe).values())
    hashed: list[torch.nn.Module] = []
    taken = changes.signature
    monkeypatch.setattr(changes, "signature", lambda module, state=None, **kw: hashed.append(module) or taken(
        module, state, **kw))
    images(pipe, "sd")
    assert hashed == []
    images(pipe, "sd", callback_on_step_end=_at_step(0, lambda p: p.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)))
    assert pipe.unet in hashed  # FreeU set between two steps: the replicated unet compared and its copy made again
    images(pipe, "sd")  # each model that ran before the change compares itself once, finds nothing and records it
    hashed.clear()
    images(pipe, "sd")
    assert hashed == []


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced_ultra_low_memory", "parallel"])
def test_a_lora_loaded_from_another_thread_waits_for_the_running_call(loras, strategy):
    pipe, _ = placed("sd", strategy)
    reference = plain("sd")
    before = images(reference, "sd")
    reference.load_lora_weights(loras["sd"], adapter_name="a")
    after = images(reference, "sd")
    order, inside = [], threading.Event()

    def slow_step(p, index, timestep, tensors):
        inside.set()
        threading.Event().wait(0.3)  # the loading thread is waiting on the call by now
        return {}

    def load():
        inside.wait(30)
        pipe.load_lora_weights(loras["sd"], adapter_name="a")
        order.append("loaded")

    loader = threading.Thread(target=load)
    loader.start()
    during = images(pipe, "sd", callback_on_step_end=slow_step)
    order.append("called")
    loader.join(60)
    assert order == ["called", "loaded"]
    torch.testing.assert_close(during, before, atol=1e-5, rtol=0)  # the call ran whole without the LoRA
    torch.testing.assert_close(images(pipe, "sd"), after, atol=1e-5, rtol=0)
    assert strays(pipe) == []


@pytest.mark.slow
def test_a_placed_pipeline_refuses_deepcopy_and_pickle_naming_reset():
    pipe, _ = placed("sd", "balanced")
    for name, make in (("copy.deepcopy", copy.deepcopy), ("pickl", pickle.dumps)):
        with pytest.raises(PipelineMappedError, match="pipemap.reset") as caught:
            make(pipe)
        assert name in caught.value.operation
    pipemap.reset(pipe)
    torch.testing.assert_close(images(pickle.loads(pickle.dumps(pipe)), "sd"), images(plain("sd"), "sd"))
    assert copy.deepcopy(pipe) is not pipe



@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deepcopy_and_pickle_are_refused_by_name_in_every_mode_and_leave_the_pipeline_as_it_ran(strategy):
    # kept a refusal (issue 39 allows it): a copy's weights would have to be read back from every mode (offloaded,
    # streamed, disk tier, replicated) without touching the placed original, which only pipemap.reset does, in place
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe, _ = placed("sd", strategy)
    before = images(pipe, "sd")
    shared = StableDiffusionImg2ImgPipeline.from_pipe(pipe)  # a from_pipe copy holds the same placed models
    for each in (pipe, shared):
        for name, make in (("copy.deepcopy", copy.deepcopy), ("pickl", pickle.dumps)):
            with pytest.raises(PipelineMappedError, match="pipemap.reset") as caught:
                make(each)
            assert name in caught.value.operation
    torch.testing.assert_close(images(pipe, "sd"), before, atol=0, rtol=0)
    assert strays(pipe) == []


def _controlnet_copy(pipe):
    from diffusers import StableDiffusionControlNetPipeline

    net = tiny.build("controlnet").controlnet
    made = StableDiffusionControlNetPipeline.from_pipe(pipe, controlnet=net)
    made.set_progress_bar_config(disable=True)
    return made


def _controlnet_call(made) -> dict:
    return {**tiny.default_call(made, "controlnet")}


@pytest.mark.slow
def test_a_from_pipe_copy_with_a_controlnet_is_placed_on_the_same_plan(fake_cuda):
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    pipemap.dispatch(pipe, two_gpu_plan(pipe, "balanced"))
    reference = _controlnet_copy(plain("sd"))
    made = _controlnet_copy(pipe)
    assert next(made.controlnet.parameters()).device.type == "cuda"  # planned in, resident where room is left
    assert set(made.hf_device_map) == {*pipe.hf_device_map, "controlnet"}
    got = made(**_controlnet_call(made)).images
    want = reference(**_controlnet_call(reference)).images
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=1e-5, rtol=0)
    pipemap.follow(made)  # nothing left to place: no error, nothing moves
    own = two_gpu_plan(made, "balanced")
    pipemap.dispatch(made, own)  # the copy placed on a plan of its own; the original, sharing its models, follows
    assert planned(made) == own and any(c is pipe for c in record_of(made).copies)
    assert {p.component for p in planned(pipe).components} == {"unet", "vae", "text_encoder"}
    assert all(planned(pipe).device_map[n] == own.device_map[n] for n in planned(pipe).device_map)
    got = made(**_controlnet_call(made)).images
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=1e-5, rtol=0)
    torch.testing.assert_close(images(pipe, "sd"), images(plain("sd"), "sd"), atol=1e-5, rtol=0)
    with pytest.raises(PipelineMappedError, match="pipemap.reset"):
        pipemap.dispatch(made, own)  # placed by dispatch itself now: a second dispatch needs reset
    made.remove_all_hooks()  # diffusers' own undo: both reset, nothing half placed
    assert planned(pipe) is None
    assert all(getattr(m, "_hf_hook", None) is None for m in made.components.values())
    torch.testing.assert_close(images(pipe, "sd"), images(plain("sd"), "sd"), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_copy_made_from_the_components_is_placed_by_follow_and_dispatch_says_so():
    pipe, _ = placed("sd", "balanced")
    made = type(pipe).__mro__[1](**pipe.components)  # the pipeline class itself, not pipemap's guarded one
    with pytest.raises(PlanMismatchError, match="pipemap.follow"):
        pipemap.dispatch(made, two_gpu_plan(made, "balanced").remap(ON_CPU))
    pipemap.follow(made)
    assert made.hf_device_map == pipe.hf_device_map
    made.set_progress_bar_config(disable=True)
    torch.testing.assert_close(images(made, "sd"), images(plain("sd"), "sd"), atol=1e-5, rtol=0)


def _interrupt_once(pipe) -> None:
    seen = [0]

    def interrupt(module, args):
        if threading.current_thread() is threading.main_thread():
            seen[0] += 1
            if seen[0] == 2:
                raise KeyboardInterrupt

    handle = pipe.unet.mid_block.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            images(pipe, "sd")
    finally:
        handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced_ultra_low_memory", "parallel"])
def test_ctrl_c_mid_forward_gives_every_buffer_and_copy_back(fake_cuda, strategy):
    import gc

    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    pipemap.dispatch(pipe, two_gpu_plan(pipe, strategy))
    want = images(pipe, "sd")
    gc.collect()
    held = dict(fake_cuda.allocated)
    for _ in range(2):
        _interrupt_once(pipe)
        torch.testing.assert_close(images(pipe, "sd"), want)  # and the next call runs as before
        gc.collect()
        assert dict(fake_cuda.allocated) == held
    pipemap.reset(pipe)


def _text_encoder_lora(folder) -> str:
    """A random LoRA of the tiny SDXL's first text encoder, saved as diffusers' training scripts save one."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = plain("sdxl")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
        inject_adapter_in_model(config, pipe.text_encoder)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.text_encoder))
    type(pipe).save_lora_weights(str(folder), text_encoder_lora_layers=layers, safe_serialization=True)
    return str(folder)


def _encoded(pipe) -> tuple[torch.Tensor, ...]:
    return tuple(t.cpu() for t in pipe.encode_prompt("a tiny cat", device=pipe._execution_device,
                                                     num_images_per_prompt=1, do_classifier_free_guidance=True))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced_low_memory", "balanced_ultra_low_memory"])
def test_a_text_encoder_lora_then_encode_prompt_before_any_call(fake_cuda, tmp_path, strategy):
    # prompt embeddings precomputed right after loading a LoRA: the encoder's own call follows the change (an
    # offloaded or streamed encoder's new LoRA layers packed into its group), no pipeline call needed first
    folder = _text_encoder_lora(tmp_path)
    pipe = tiny.build("sdxl")
    pipe.set_progress_bar_config(disable=True)
    plan = two_gpu_plan(pipe, strategy)
    assert plan.placement("text_encoder").mode in ("offload", "stream")
    pipemap.dispatch(pipe, plan)
    reference = plain("sdxl")
    for each in (pipe, reference):
        each.load_lora_weights(folder, adapter_name="te")
    for got, want in zip(_encoded(pipe), _encoded(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    pipemap.reset(pipe)


def test_a_from_pipe_copy_dispatched_on_a_plan_that_does_not_fit_it_leaves_both_as_they_were(tiny_folders):
    pipe = pipemap.load(tiny_folders["sd"], hardware="cpu=1GiB", progress=False)
    before = planned(pipe)
    made = _controlnet_copy(pipe)
    with pytest.raises(PlanMismatchError) as refused:
        pipemap.dispatch(made, before)  # the original's plan: no ControlNet in it
    assert refused.value.component == "controlnet"
    assert planned(pipe) is before and any(c is made for c in record_of(pipe).copies)
    assert set(made.hf_device_map) == {*pipe.hf_device_map, "controlnet"}
