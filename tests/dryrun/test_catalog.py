"""dryrun/catalog.py: a catalog pipeline at full size for the dry run, nothing downloaded: its models built from the
published configs with fake weights at each component's dtype, stand-in tokenizers with the published lengths, the
published scheduler. Full-size pipelines are slow: the quick tests build one component at a time."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import pipemap
from helpers import inventory, plan
from pipemap import catalog
from pipemap.dryrun import catalog as dryrun_catalog
from pipemap.dryrun import standin

SD15 = "stable-diffusion-1.5"


@pytest.fixture
def mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def _plan(dtype=None):
    return plan(inventory(("vae", 10), dtype=dtype), "1x1GiB")


def test_tokenizer_pads_and_truncates_to_its_length():
    tokenizer = dryrun_catalog.tokenizer(8)
    assert tokenizer.model_max_length == 8
    short = tokenizer("a photo of a cat", padding="max_length", max_length=8, truncation=True)
    assert short.input_ids == [2] * 5 + [tokenizer.pad_token_id] * 3 and short.attention_mask == [1] * 5 + [0] * 3
    long = tokenizer(" ".join(["word"] * 20), padding="max_length", max_length=8, truncation=True)
    assert long.input_ids == [2] * 8 and long.attention_mask == [1] * 8
    batch = tokenizer(["a cat", "a very small cat"], padding="max_length", max_length=8, truncation=True,
                      return_tensors="pt")
    assert batch.input_ids.shape == (2, 8) and batch.attention_mask.sum(1).tolist() == [2, 4]


def test_tokenizer_makes_one_token_per_word_or_punctuation_run_every_id_small():
    tokenizer = dryrun_catalog.tokenizer(77)
    ids = tokenizer("a cat, a dog!!").input_ids
    assert len(ids) == 6  # a / cat / , / a / dog / !!
    assert max(ids) < 4  # valid for any text encoder's embedding
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 3)


def test_each_tokenizer_is_its_own():
    first, second = dryrun_catalog.tokenizer(77), dryrun_catalog.tokenizer(512)
    first.add_tokens(["cat"])  # changing one leaves the next alone (the shared backend is copied)
    assert len(first("cat").input_ids) == 1 and first("cat").input_ids != second("cat").input_ids
    assert dryrun_catalog.tokenizer(77)("cat").input_ids == second("cat").input_ids == [2]
    assert second.model_max_length == 512


def test_a_model_is_built_at_its_published_size_with_fake_weights_in_eval_mode(mode):
    found = catalog.entries()[SD15]
    model = dryrun_catalog._fake_model(found, "text_encoder", _plan(), mode, "meta:1")
    assert type(model).__name__ == "CLIPTextModel" and not model.training
    assert all(isinstance(p, FakeTensor) and str(p.device) == "meta:1" for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # the published dtype
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert size == catalog.recorded_sizes()[SD15]["text_encoder"]  # what the published checkpoint holds


@pytest.mark.parametrize(("dtype", "vae", "transformer"), [
    (None, torch.float32, torch.bfloat16),  # the published dtype: each component keeps its own (Wan's VAE: fp32)
    ("bfloat16", torch.float32, torch.bfloat16),
    ("float16", torch.float16, torch.float16),  # another dtype applies to all
    ("float32", torch.float32, torch.float32),
])
def test_each_component_gets_its_own_dtype_unless_the_plan_asks_another(dtype, vae, transformer):
    found = catalog.entries()["wan2.1-t2v-14b"]
    assert dryrun_catalog._dtype(found, "vae", _plan(dtype)) == vae
    assert dryrun_catalog._dtype(found, "transformer", _plan(dtype)) == transformer


def test_the_scheduler_is_the_published_class_and_config():
    found = catalog.entries()[SD15]
    scheduler = dryrun_catalog._scheduler(found.model_index["scheduler"][1], found.scheduler_config)
    assert type(scheduler).__name__ == "PNDMScheduler"
    assert (scheduler.config.beta_end, scheduler.config.steps_offset, scheduler.config.skip_prk_steps) == \
        (0.012, 1, True)


def test_the_stand_in_tokenizer_formats_messages_for_chat_template_pipelines():
    # FLUX.2 builds its prompt from messages (apply_chat_template) and pads them to 512 tokens
    messages = [[{"role": "system", "content": [{"type": "text", "text": "You are an artist"}]},
                 {"role": "user", "content": [{"type": "text", "text": "a cat"}]}]]
    found = dryrun_catalog.tokenizer(512).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
        max_length=512)
    assert found["input_ids"].shape == (1, 512) and found["attention_mask"].sum() == 6  # one token a word


def test_the_vision_processor_repeats_the_image_token_once_per_merged_patch():
    # Qwen-Image-Edit's prompt holds one <|image_pad|>, which the processor makes one token per 2x2 merge of the
    # image's 14-pixel patches: a 448x448 image is 32x32 patches, 256 tokens, at the text encoder's id for them
    from PIL import Image

    processor = dryrun_catalog._vision_processor(catalog.entries()["qwen-image-edit"])
    found = processor(text=["describe <|vision_start|><|image_pad|><|vision_end|> a red hat"],
                      images=[Image.new("RGB", (448, 448))], padding=True, return_tensors="pt")
    image_token = catalog.entries()["qwen-image-edit"].configs["text_encoder"]["image_token_id"]
    assert found["image_grid_thw"].tolist() == [[1, 32, 32]] and found["pixel_values"].shape[0] == 32 * 32
    assert (found["input_ids"] == image_token).sum() == 256 and found["input_ids"].shape == (1, 1 + 258 + 3)


def test_a_processor_that_cannot_be_built_is_left_out():
    assert dryrun_catalog._other("transformers", "NoSuchProcessor") is None
    assert type(dryrun_catalog._other("transformers", "CLIPImageProcessor")).__name__.startswith("CLIPImageProcessor")


@pytest.mark.slow
def test_a_full_size_pipeline_holds_fake_models_on_their_stand_ins(mode):
    plan = pipemap.plan("sd1.5", hardware="2x2GiB,cpu=8GiB")
    standins = standin.devices_for(plan)
    device_of = {p.component: standins[p.device] for p in plan.components}
    pipe = dryrun_catalog.pipeline(catalog.resolve("sd1.5"), plan, mode, device_of)
    assert type(pipe).__name__ == "StableDiffusionPipeline" and pipe.tokenizer.model_max_length == 77
    for name, device in device_of.items():
        module = getattr(pipe, name)
        assert not module.training, name
        assert all(isinstance(p, FakeTensor) and str(p.device) == device for p in module.parameters()), name
    recorded = catalog.recorded_sizes()[SD15]
    unet = sum(p.numel() * p.element_size() for p in pipe.unet.parameters())
    assert unet == pytest.approx(recorded["unet"], rel=0.01)


@pytest.mark.slow
def test_a_catalog_pipeline_plans_with_measured_headroom_and_dry_runs_with_nothing_downloaded():
    # the suite's one catalog dry run: SD 1.5 at full size (860M-parameter UNet, safety checker), small images
    call = {"height": 256, "width": 256, "steps": 1}
    plan = pipemap.plan("sd1.5", hardware="2x2GiB,cpu=8GiB", strategy="auto", headroom="measure", call=call)
    assert any("headroom measured" in n for n in plan.notes)
    report = pipemap.simulate("sd1.5", plan, **call)
    assert report.ok, report.error
    for device in plan.devices:
        if device.used:
            assert report.peak_bytes[device.device] <= device.memory
            assert report.weight_bytes[device.device] == pytest.approx(device.used, rel=0.01)
    assert "VAE decode" in report.peak_phase.values()
    assert set(report.peak_phase.values()) <= {"prompt encoding", "denoising (step 1)", "VAE decode", "safety check"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stable-diffusion-2.1"])
def test_new_catalog_pipelines_dry_run_at_full_size_on_two_24_gib_gpus(name):
    # the cheapest of the new entries at its own default call (768x768), 1 step: 9 s (SANA's 1024x1024: 18 s); every
    # entry's default call was dry-run at full size to count its work (catalog/counts.record, test_counted.py checks
    # each is there)
    plan = pipemap.plan(name, hardware="2x24GiB,cpu=64GiB", strategy="auto")
    report = pipemap.simulate(name, plan, steps=1, advice=False)
    assert report.fits, (report.error, report.overruns)
    assert set(report.peak_phase.values()) >= {"prompt encoding", "VAE decode"}


@pytest.mark.slow  # two full-size dry runs, the headroom's then the plan's: about a minute
def test_an_editing_pipeline_dry_runs_at_full_size_with_its_image_to_edit():
    # Qwen-Image-Edit-2509 gets a blank image to edit (dryrun.run.EDITS): it goes through Qwen2.5-VL's vision tower
    # (the stand-in VisionProcessor) and the VAE's encoder, and its latents double the transformer's tokens. The
    # default 10% headroom of a 24 GiB GPU is short of that (the auto plan's dry run peaks at 24.04 GiB on cuda:1);
    # the headroom a dry run measures fits
    name = "qwen-image-edit-2509"
    plan = pipemap.plan(name, hardware="2x24GiB,cpu=64GiB", strategy="auto", headroom="measure", call={"steps": 1})
    assert any("headroom measured" in n for n in plan.notes)
    report = pipemap.simulate(name, plan, steps=1, advice=False)
    assert report.fits, (report.error, report.overruns)
