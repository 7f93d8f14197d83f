"""Which denoisers strategy ``"parallel"`` copies, and what the plan says (``pipemap.replication``): read from the
diffusers pipeline classes' own code, and seen in the plans made with it."""

from __future__ import annotations

import pytest

import pipemap
from helpers import replica_inventory
from pipemap import Component, Inventory
from pipemap.plan import Placement
from pipemap.replication import batches_guidance, copy_counts, parallel_modes, plan_notes, replicable, splits_sequence


def test_parallel_gives_no_replicas_to_a_pipeline_it_cannot_read_and_says_why():
    plan = pipemap.plan(replica_inventory("MyOwnPipeline"), hardware="2x16GiB,cpu=64GiB", strategy="parallel")
    assert {p.mode for p in plan.components} == {"resident"} and plan.strategy == "parallel"
    assert "not a diffusers pipeline class" in plan.notes[-1] and "placed as balanced" in plan.notes[-1]
    balanced = pipemap.plan(replica_inventory("MyOwnPipeline"), hardware="2x16GiB,cpu=64GiB")
    assert plan.device_map == balanced.device_map


# text encoder 2 GiB, transformer 10 GiB (a model class without a context-parallel plan), vae 1 GiB on 3 x 16 GiB;
# the call with a negative prompt (true CFG: two denoiser calls a step; Wan's default call already has them)
TRUE_CFG_CALL = {"negative_prompt": "blurry", "true_cfg_scale": 4.0}


@pytest.mark.parametrize("pipeline_class", ["FluxPipeline", "WanPipeline", "QwenImagePipeline"])
def test_parallel_runs_guidance_branches_at_once_where_the_pipeline_calls_once_per_branch(pipeline_class):
    plan = pipemap.plan(replica_inventory(pipeline_class), hardware="3x16GiB,cpu=64GiB", strategy="parallel",
                        headroom=0.0, call=TRUE_CFG_CALL)
    transformer = plan.placement("transformer")
    assert (transformer.mode, transformer.device, transformer.replicas) == ("guidance", "cuda:0", ("cuda:1",))
    assert plan.execution_device == "cuda:0"
    assert {d.device: d.used for d in plan.devices}["cuda:1"] == 10 * 2**30  # the copy: two branches, two GPUs
    assert "cuda:0 runs each step's first call (conditional), cuda:1 its second" in plan.notes[-1]
    assert "true CFG, 2 calls a step" in plan.notes[-2]  # the call it chose for


@pytest.mark.parametrize("pipeline_class", ["FluxPipeline", "QwenImagePipeline"])
def test_parallel_makes_no_guidance_copy_for_a_call_of_one_denoiser_call_a_step(pipeline_class):
    # guidance-distilled FLUX.1-dev, Qwen-Image without a negative prompt: a copy would compute a second branch no
    # call uses; this transformer's class has no context-parallel plan either, so no copy at all, and it says why
    plan = pipemap.plan(replica_inventory(pipeline_class), hardware="3x16GiB,cpu=64GiB", strategy="parallel",
                        headroom=0.0)
    assert all(not p.replicas for p in plan.components)
    assert "one denoiser call a step" in plan.notes[-2] and "no context-parallel plan" in plan.notes[-1]


def _model(name: str, class_name: str, size: int = 100) -> Component:
    return Component(name, "diffusers", class_name, size, True)


@pytest.mark.parametrize(("pipeline_class", "denoiser", "modes"), [
    ("StableDiffusionXLPipeline", "UNet2DConditionModel", ("replicated",)),
    ("FluxPipeline", "FluxTransformer2DModel", ("sequence",)),  # guidance-distilled: 1 call a step, no 2nd branch
    # its default call has no negative prompt, so no true CFG: 1 call a step (``cost.TRUE_CFG``): tokens split
    ("QwenImagePipeline", "QwenImageTransformer2DModel", ("sequence",)),
    ("WanPipeline", "WanTransformer3DModel", ("guidance", "sequence")),
    ("MyOwnPipeline", "FluxTransformer2DModel", ("sequence",)),  # the model class alone says it can split
    ("MyOwnPipeline", "Model", ()),
])
def test_parallel_modes_are_those_the_calls_allow_fastest_first(pipeline_class, denoiser, modes):
    name = "unet" if "UNet" in denoiser else "transformer"
    inv = Inventory("test", pipeline_class, (_model("text_encoder", "CLIPTextModel"), _model(name, denoiser, 10**10)),
                    "bfloat16")
    assert parallel_modes(inv) == tuple((name, m) for m in modes)
    assert splits_sequence(denoiser) is ("sequence" in modes)


# text encoder 2 GiB, transformer 10 GiB, vae 1 GiB: 2 x 16 GiB hold a copy of the transformer each, 3 x 11 GiB
# only two copies beside the rest, 2 x 11 GiB none (a copy on each leaves 1 GiB, not the text encoder's 2)
def test_parallel_places_copies_where_room_allows():
    inv = replica_inventory("StableDiffusion3Pipeline")
    two = pipemap.plan(inv, hardware="2x16GiB,cpu=64GiB", strategy="parallel", headroom=0.0)
    assert two.placement("transformer").replicas == ("cuda:1",)
    assert {d.device: d.used for d in two.devices} == {"cuda:0": 12 * 2**30, "cuda:1": 11 * 2**30, "cpu": 0}
    three = pipemap.plan(inv, hardware="3x11GiB,cpu=64GiB", strategy="parallel", headroom=0.0)
    assert three.placement("transformer").replicas == ("cuda:1",)
    assert {three.device_map["text_encoder"], three.device_map["vae"]} == {"cuda:2"}
    none = pipemap.plan(inv, hardware="2x11GiB,cpu=64GiB", strategy="parallel", headroom=0.0)
    assert none.placement("transformer").mode == "resident" and "no two GPUs hold a copy" in none.notes[-1]
    assert pipemap.Plan.from_json(three.to_json()) == three
    on_cpu = three.remap({"cuda:0": "cpu", "cuda:1": "cpu", "cuda:2": "cpu"})
    assert on_cpu.placement("transformer").replicas == ("cpu",)


@pytest.mark.parametrize(("pipeline_class", "batched"), [
    ("StableDiffusionPipeline", True),  # torch.cat([latents] * 2): both guidance branches in one call
    ("StableDiffusionXLPipeline", True),
    ("StableDiffusionControlNetPipeline", True),
    ("StableDiffusion3Pipeline", True),
    ("FluxPipeline", False),  # true CFG: the transformer called once per branch
    ("WanPipeline", False),
    ("QwenImagePipeline", False),
    ("MyOwnPipeline", None),  # no such diffusers class: nothing to read
])
def test_batches_guidance_reads_the_pipeline_class(pipeline_class, batched):
    assert batches_guidance(pipeline_class) is batched


def _inventory(pipeline_class: str, *names: str) -> Inventory:
    return Inventory("test", pipeline_class, tuple(Component(n, "diffusers", "Model", 100, True) for n in names))


def test_replicable_is_the_denoiser_of_a_batching_pipeline():
    assert replicable(_inventory("StableDiffusionPipeline", "text_encoder", "unet", "vae")) == ("unet",)
    assert replicable(replica_inventory("StableDiffusion3Pipeline")) == ("transformer",)
    assert replicable(replica_inventory("FluxPipeline")) == ()
    assert replicable(_inventory("StableDiffusionPipeline", "text_encoder", "vae")) == ()  # no denoiser


def test_plan_notes_say_what_was_done_with_the_denoiser_and_why():
    sd = _inventory("StableDiffusionPipeline", "text_encoder", "unet", "vae")
    copied = {"unet": Placement("unet", "cuda:0", 100, "replicated", replicas=("cuda:1", "cuda:2"))}
    assert plan_notes(sd, copied) == ["parallel: unet replicated on cuda:0, cuda:1, cuda:2; each call's batch "
                                      "(guidance, images per prompt) is split across the copies"]
    [note] = plan_notes(sd, {"unet": Placement("unet", "cuda:0", 100)})
    assert "no two GPUs hold a copy of the unet (100 B)" in note and note.endswith("placed as balanced")
    [note] = plan_notes(replica_inventory("MyOwnPipeline"), {})
    assert "MyOwnPipeline is not a diffusers pipeline class" in note and "Model has no context-parallel plan" in note
    flux = replica_inventory("FluxPipeline")
    [note] = plan_notes(flux, {"transformer": Placement("transformer", "cuda:1", 100, "sequence",
                                                         replicas=("cuda:0",))})
    assert note.startswith("parallel: transformer tokens split across cuda:1, cuda:0: each GPU computes its share")
    assert "cuda:1 returns the output" in note
    assert plan_notes(_inventory("StableDiffusionPipeline", "vae"), {}) == [
        "parallel: no denoiser to replicate; placed as balanced"]


def test_a_plan_without_copies_is_the_balanced_plan():
    inv = _inventory("WanPipeline", "text_encoder", "transformer", "vae")  # true CFG by default
    plan = pipemap.plan(inv, hardware="cuda:0=200,cuda:1=150,cpu=10000", strategy="parallel", headroom=0.0)
    assert plan.device_map == pipemap.plan(inv, hardware="cuda:0=200,cuda:1=150,cpu=10000", headroom=0.0).device_map
    assert plan.notes[-1] == plan_notes(inv, {p.component: p for p in plan.components})[0]
    assert "no two GPUs hold a copy of the transformer (100 B)" in plan.notes[-1]


@pytest.mark.parametrize(("mode", "gpus", "heads", "counts"), [
    ("guidance", 4, 24, [2]),
    ("sequence", 8, 24, [8, 4, 2]),
    ("sequence", 8, 3, []),  # Ulysses gives each GPU a share of the heads
    ("guidance_sequence", 3, 24, []),  # two branches of at least two GPUs each
    ("guidance_sequence", 8, 40, [8, 4]),  # each branch split over 4, or over 2
    ("guidance_sequence", 16, 0, [16, 8, 4]),  # heads unknown: any power of two
    ("replicated", 3, 0, [3, 2]),
])
def test_copy_counts_are_the_gpu_counts_each_mode_can_run_on(mode, gpus, heads, counts):
    assert copy_counts(mode, gpus, heads) == counts


def test_with_four_gpus_a_pipeline_calling_once_per_branch_may_split_each_branch():
    inv = Inventory("test", "WanPipeline", (_model("text_encoder", "UMT5EncoderModel"),
                                             _model("transformer", "WanTransformer3DModel", 10**10)), "bfloat16")
    assert "guidance_sequence" not in {m for _, m in parallel_modes(inv, gpus=2)}
    assert {m for _, m in parallel_modes(inv, gpus=4)} == {"guidance", "sequence", "guidance_sequence"}
