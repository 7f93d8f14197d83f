"""The catalog: published pipelines sized from their configs on the meta device, nothing downloaded.

Each entry's parameter counts are checked against the figure its publisher gives. A published figure is our exact
count rounded to the digits it shows, so the tolerance is half a unit in its last digit ("12B" admits 11.5B to
12.5B, "123.65M" admits 123.645M to 123.655M): `_rounds_to` below. That is as tight as the figure allows and still
catches a wrong config: one transformer block too many or too few moves every denoiser by more than that (a Flux
double block is 340M, half a unit of "12B" is 500M, but a wrong hidden size or layer count moves it by billions).
Sizes at a dtype are checked exactly against the parameter counts.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import psutil
import pytest
import torch

import pipemap
from pipemap import catalog

_UNITS = {"M": 10**6, "B": 10**9}


def _rounds_to(count: int, published: str) -> bool:
    """Whether ``count`` rounds to ``published`` ("11.9B", "860M") at the digits that figure shows."""
    figure = Decimal(published[:-1])
    unit = Decimal(_UNITS[published[-1]])
    half = Decimal(1).scaleb(figure.as_tuple().exponent) / 2 * unit
    return abs(Decimal(count) - figure * unit) <= half


@pytest.mark.parametrize(("count", "published", "ok"), [
    (11_901_408_320, "12B", True), (11_901_408_320, "11.9B", True), (12_600_000_000, "12B", False),
    (123_650_304, "123.65M", True), (123_660_304, "123.65M", False), (859_520_964, "860M", True),
])
def test_rounds_to_is_half_a_unit_in_the_last_digit(count, published, ok):
    assert _rounds_to(count, published) is ok


# ---- one test per entry: its parameter counts against the published figures ------------------------------------


def test_stable_diffusion_1_5_counts():
    counts = catalog.parameter_count("stable-diffusion-1.5")
    # CompVis/stable-diffusion README (SD v1): "a 860M UNet and 123M text encoder"
    assert _rounds_to(counts["unet"], "860M")
    assert _rounds_to(counts["text_encoder"], "123M")
    # the safety checker is OpenAI CLIP ViT-L/14's vision tower plus its projection (303.97M in open_clip's
    # docs/model_profile.csv, image_mparams of ViT-L-14) plus 20 concept embeddings of 768 and their 20 weights
    assert counts["safety_checker"] - (17 + 3) * (768 + 1) == pytest.approx(303.97e6, abs=0.005e6)
    # vae/diffusion_pytorch_model.safetensors is listed at 335 MB on the Hub, in fp32: 4 bytes a parameter
    assert _rounds_to(counts["vae"] * 4, "335M")


def test_sdxl_counts():
    counts = catalog.parameter_count("sdxl")
    # SDXL paper (Podell et al. 2023, arXiv:2307.01952), Table 1: "# UNet params 2.6B"
    assert _rounds_to(counts["unet"], "2.6B")
    # open_clip docs/model_profile.csv: ViT-bigG-14 text_mparams 694.66 (the text tower with its projection)
    assert _rounds_to(counts["text_encoder_2"], "694.66M")
    assert _rounds_to(counts["text_encoder"], "123M")  # the same CLIP-L text tower as SD 1.5
    assert _rounds_to(counts["vae"] * 4, "335M")  # vae/diffusion_pytorch_model.safetensors, fp32, 335 MB


def test_sd3_5_large_counts():
    counts = catalog.parameter_count("sd3.5-large")
    # Stability AI's SD 3.5 announcement and model card: "Stable Diffusion 3.5 Large: At 8.1 billion parameters"
    assert _rounds_to(counts["transformer"], "8.1B")
    # open_clip docs/model_profile.csv: ViT-L-14 text_mparams 123.65, ViT-bigG-14 text_mparams 694.66 (both
    # CLIPTextModelWithProjection here, so the projection is counted as open_clip counts it)
    assert _rounds_to(counts["text_encoder"], "123.65M")
    assert _rounds_to(counts["text_encoder_2"], "694.66M")
    # SD3 paper (Esser et al. 2024, arXiv:2403.03206): "the 4.7B parameter T5 text encoder". The paper
    # truncates (4.76B), so here the figure is a floor: [4.7B, 4.8B)
    assert 4.7e9 <= counts["text_encoder_3"] < 4.8e9


def test_flux_1_dev_counts():
    counts = catalog.parameter_count("flux.1-dev")
    # FLUX.1 [dev] model card: "a 12 billion parameter rectified flow transformer"
    assert _rounds_to(counts["transformer"], "12B")
    assert _rounds_to(counts["transformer"], "11.9B")  # the figure diffusers' Flux docs and the brief quote
    assert 4.7e9 <= counts["text_encoder_2"] < 4.8e9  # T5-XXL encoder, as for SD 3.5 (SD3 paper: 4.7B)
    assert _rounds_to(counts["text_encoder"], "123M")  # CLIP-L text tower, as for SD 1.5
    # ae.safetensors is listed at 335 MB on the Hub, in fp32
    assert _rounds_to(counts["vae"] * 4, "335M")


def test_wan_2_1_t2v_14b_counts():
    counts = catalog.parameter_count("wan2.1-t2v-14b")
    # Wan2.1 model card (Wan-AI/Wan2.1-T2V-14B): "T2V-14B", the 14B-parameter text-to-video model
    assert _rounds_to(counts["transformer"], "14B")
    # Wan-AI/Wan2.1-T2V-14B ships the encoder as models_t5_umt5-xxl-enc-bf16.pth, 11.4 GB: 2 bytes a parameter
    assert _rounds_to(counts["text_encoder"] * 2, "11.4B")
    # ... and the VAE as Wan2.1_VAE.pth, 508 MB, in fp32
    assert _rounds_to(counts["vae"] * 4, "508M")


def test_qwen_image_counts():
    counts = catalog.parameter_count("qwen-image")
    # Qwen-Image model card and technical report (arXiv:2508.02324): "a 20B MMDiT image foundation model"
    assert _rounds_to(counts["transformer"], "20B")
    # Qwen/Qwen2.5-VL-7B-Instruct on the Hub: "Model size 8.29B params" (its safetensors metadata)
    assert _rounds_to(counts["text_encoder"], "8.29B")
    # the Qwen-Image VAE is Wan 2.1's architecture (fine-tuned decoder): the same count as Wan's 508 MB fp32 file
    assert counts["vae"] == catalog.parameter_count("wan2.1-t2v-14b")["vae"]


# The entries derived from another's configs (the same architecture retrained or distilled), and the rest with the
# figure their publisher gives for the denoiser: (name, denoiser, figure, where it is published).
PUBLISHED = [
    ("flux.1-schnell", "transformer", "12B", "FLUX.1 [schnell] model card: a 12 billion parameter rectified flow "
     "transformer (dev's without its guidance embedder: 10.2M fewer)"),
    ("flux.1-kontext-dev", "transformer", "12B", "FLUX.1 Kontext [dev] model card: a 12 billion parameter rectified "
     "flow transformer"),
    ("flux.1-krea-dev", "transformer", "12B", "FLUX.1 Krea [dev] model card: a 12 billion parameter rectified flow "
     "transformer"),
    ("chroma1-hd", "transformer", "8.9B", "Chroma model card: an 8.9B parameter model based on FLUX.1-schnell"),
    ("stable-diffusion-3.5-large-turbo", "transformer", "8.1B", "SD 3.5 announcement: Large Turbo, a distilled "
     "version of Large"),
    ("sdxl-turbo", "unet", "2.6B", "SDXL Turbo is a distilled SDXL 1.0 (SDXL paper: 2.6B UNet)"),
    ("pixart-sigma-xl-2-1024-ms", "transformer", "0.6B", "PixArt-Sigma paper (arXiv:2403.04692): a 0.6B DiT"),
    ("sana-1600m-1024px", "transformer", "1.6B", "SANA paper (arXiv:2410.10629): Sana-1.6B"),
    ("lumina-image-2.0", "transformer", "2.6B", "Lumina-Image 2.0 model card: a 2.6B parameter flow-based DiT"),
    ("cogvideox-2b", "transformer", "2B", "CogVideoX model card: CogVideoX-2B"),
    ("ltx-video", "transformer", "2B", "LTX-Video model card: the 2B-parameter 0.9 models"),
    ("hunyuanvideo", "transformer", "13B", "HunyuanVideo paper (arXiv:2412.03603): a 13B parameter video model"),
    ("wan2.2-t2v-a14b", "transformer", "14B", "Wan 2.2 model card: A14B, a 27B MoE of two 14B experts, 14B active"),
    ("wan2.2-t2v-a14b", "transformer_2", "14B", "Wan 2.2 model card: the low-noise expert, 14B"),
    ("wan2.2-ti2v-5b", "transformer", "5.0B", "Wan 2.2 model card: TI2V-5B, a 5B dense model"),
    ("qwen-image-edit", "transformer", "20B", "Qwen-Image-Edit model card: built on the 20B Qwen-Image"),
    ("qwen-image-edit-2509", "transformer", "20B", "Qwen-Image-Edit-2509 model card: Qwen-Image-Edit's 20B, retrained"),
    ("qwen-image-edit", "text_encoder", "8.29B", "Qwen/Qwen2.5-VL-7B-Instruct on the Hub: 8.29B params"),
    ("flux.2-dev", "transformer", "32B", "FLUX.2 [dev] model card: a 32 billion parameter flow transformer"),
    ("flux.2-dev", "text_encoder", "24B", "Mistral Small 3.1/3.2 model card: 24B parameters (its vision tower and "
     "output head included)"),
    ("hidream-i1-full", "transformer", "17B", "HiDream-I1 model card: an image generative foundation model with 17B "
     "parameters"),
    ("hidream-i1-full", "text_encoder_4", "8.03B", "meta-llama/Llama-3.1-8B-Instruct on the Hub: 8.03B params"),
]


@pytest.mark.slow  # each entry's skeletons on the meta device: 1 to 2 s
@pytest.mark.parametrize(("name", "denoiser", "figure", "source"), PUBLISHED, ids=[f"{p[0]}-{p[1]}" for p in PUBLISHED])
def test_each_new_entry_s_denoiser_counts_to_its_published_figure(name, denoiser, figure, source):
    assert _rounds_to(catalog.parameter_count(name)[denoiser], figure), source


@pytest.mark.slow  # five entries' skeletons: 5 s
def test_entries_the_published_figures_round_differently():
    # SD 3.5 Medium: "2.5 billion parameters" counts the saved 384 x 384 x 1536 position table, a buffer in the
    # checkpoint: 2.243B parameters + 0.226B = 2.47B, the 4.94 GB bf16 transformer file
    medium = catalog.parameter_count("sd3.5-medium")["transformer"]
    assert _rounds_to(medium + 384 * 384 * 1536, "2.5B") and _rounds_to(medium, "2.24B")
    # Wan 2.1 1.3B: the name is nominal; its published config (dim 1536, ffn 8960, 30 blocks) counts 1.42B
    assert _rounds_to(catalog.parameter_count("wan2.1-1.3b")["transformer"], "1.42B")
    # CogVideoX 5B: the config (42 blocks of 3072 with expert adaLN) counts 5.57B, the "5B" of its name
    assert _rounds_to(catalog.parameter_count("cogvideox-5b")["transformer"], "5.6B")
    # HunyuanVideo's text encoder: Llama-3-8B without its 128320 x 4096 output head (7.5B); SANA's and Lumina's
    # Gemma-2 2B (2.6B, its model card)
    assert _rounds_to(catalog.parameter_count("hunyuanvideo")["text_encoder"], "7.5B")
    assert _rounds_to(catalog.parameter_count("sana")["text_encoder"], "2.6B")
    # Wan 2.2's VAE (vae/config.json of Wan-AI/Wan2.2-TI2V-5B-Diffusers: z_dim 48, residual, 16x16x4) is shipped as
    # Wan2.2_VAE.pth, 2.82 GB in fp32
    assert _rounds_to(catalog.parameter_count("wan2.2-ti2v-5b")["vae"] * 4, "2.82B")
    # SD 2.1: Stability AI's SD 2 release, "the same number of parameters in the U-Net as 1.5": 865M, truncated
    assert 865e6 <= catalog.parameter_count("sd2.1")["unet"] < 866e6
    # HiDream-I1 Full's transformer in bf16: Comfy-Org/HiDream-I1_ComfyUI's hidream_i1_full_fp16.safetensors, 34.2 GB
    # (2 bytes a parameter); its CLIP-L: text_encoder/model.safetensors, 495 MB in fp32; its T5: two shards, 4.99 +
    # 4.53 GB in bf16
    hidream = catalog.parameter_count("hidream-i1-full")
    assert _rounds_to(hidream["transformer"] * 2, "34.2B")
    assert _rounds_to(hidream["text_encoder"] * 4, "495M")
    assert _rounds_to(hidream["text_encoder_3"] * 2, "9.52B")


# ---- names and aliases ---------------------------------------------------------------------------------------


def test_names_are_the_published_pipelines_grouped_by_family():
    assert len(catalog.names()) == 28
    assert catalog.families() == {
        "CogVideoX": ["cogvideox-2b", "cogvideox-5b"],
        "FLUX.1": ["chroma1-hd", "flux.1-dev", "flux.1-kontext-dev", "flux.1-krea-dev", "flux.1-schnell"],
        "FLUX.2": ["flux.2-dev"], "HiDream": ["hidream-i1-full"],
        "HunyuanVideo": ["hunyuanvideo"], "LTX-Video": ["ltx-video"], "Lumina": ["lumina-image-2.0"],
        "PixArt": ["pixart-sigma-xl-2-1024-ms"], "SANA": ["sana-1600m-1024px"],
        "Qwen-Image": ["qwen-image", "qwen-image-edit", "qwen-image-edit-2509"],
        "Stable Diffusion": ["sdxl-turbo", "stable-diffusion-1.5", "stable-diffusion-2.1",
                             "stable-diffusion-3.5-large", "stable-diffusion-3.5-large-turbo",
                             "stable-diffusion-3.5-medium", "stable-diffusion-xl-base-1.0"],
        "Wan": ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-t2v-a14b", "wan2.2-ti2v-5b"]}


@pytest.mark.parametrize(("typed", "near"), [
    ("flux-schnell", "flux.1-schnell"), ("fluxdev", "flux.1-dev"), ("sd35-medum", "stable-diffusion-3.5-medium"),
    ("hunyuan-vid", "hunyuanvideo")])
def test_a_near_miss_gets_the_nearest_names(typed, near):
    assert catalog.resolve(typed) is None or catalog.resolve(typed) == near
    assert near in catalog.nearest(typed)


@pytest.mark.slow  # every entry's skeletons on the meta device: seconds each
def test_every_entry_plans_for_two_24_gib_gpus():
    for name in catalog.names():
        plan = pipemap.plan(name, hardware="2x24GiB,cpu=64GiB", strategy="auto")
        assert plan.components and all(d.used <= d.memory for d in plan.devices), name


@pytest.mark.parametrize(("alias", "name"), [
    ("flux.1-dev", "flux.1-dev"), ("black-forest-labs/FLUX.1-dev", "flux.1-dev"), ("flux-dev", "flux.1-dev"),
    ("FLUX-DEV", "flux.1-dev"), (" sdxl ", "stable-diffusion-xl-base-1.0"),
    ("runwayml/stable-diffusion-v1-5", "stable-diffusion-1.5"), ("sd1.5", "stable-diffusion-1.5"),
    ("stabilityai/stable-diffusion-3.5-large", "stable-diffusion-3.5-large"),
    ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2.1-t2v-14b"), ("Qwen/Qwen-Image", "qwen-image"),
    ("black-forest-labs/FLUX.1-schnell", "flux.1-schnell"), ("Kontext", "flux.1-kontext-dev"),
    ("sd3.5-medium", "stable-diffusion-3.5-medium"), ("THUDM/CogVideoX-5b", "cogvideox-5b"),
    ("Lightricks/LTX-Video", "ltx-video"), ("hunyuanvideo-community/HunyuanVideo", "hunyuanvideo"),
    ("PixArt-Sigma", "pixart-sigma-xl-2-1024-ms"), ("sana", "sana-1600m-1024px"), ("chroma", "chroma1-hd"),
    ("Qwen/Qwen-Image-Edit", "qwen-image-edit"), ("qwen-image-edit-plus", "qwen-image-edit-2509"),
    ("black-forest-labs/FLUX.2-dev", "flux.2-dev"), ("flux2", "flux.2-dev"), ("HiDream", "hidream-i1-full"),
])
def test_resolve_accepts_names_aliases_and_repo_ids_in_any_case(alias, name):
    assert catalog.resolve(alias) == name


def test_unknown_name_resolves_to_none_and_inventory_says_what_is_known():
    assert catalog.resolve("flux.2-pro") is None
    with pytest.raises(pipemap.NotAPipelineError, match="flux.1-dev") as info:
        catalog.inventory("flux.2-pro")
    assert isinstance(info.value, ValueError)


def test_aliases_are_unique_across_entries():
    seen: dict[str, str] = {}
    for path in sorted(Path(catalog.__file__).parent.glob("*.json")):
        data = json.loads(path.read_text())
        for key in {k.lower() for k in (data["name"], data["repo"], *data["aliases"])}:
            assert seen.setdefault(key, data["name"]) == data["name"], key


# ---- inventories: bytes at a dtype are elements times the dtype's size -----------------------------------------


def test_flux_inventory_at_its_published_bf16_is_two_bytes_a_parameter():
    inv = catalog.inventory("flux.1-dev")
    counts = catalog.parameter_count("flux.1-dev")
    assert (inv.pipeline_class, inv.source, inv.dtype) == ("FluxPipeline", "black-forest-labs/FLUX.1-dev", "bfloat16")
    assert {c.name: c.bytes for c in inv.models} == {name: 2 * n for name, n in counts.items()}
    assert [c.name for c in inv.components if not c.has_weights] == ["scheduler", "tokenizer", "tokenizer_2"]


@pytest.mark.parametrize("name", ["stable-diffusion-1.5", "stable-diffusion-xl-base-1.0", "qwen-image"])
def test_inventory_at_float32_is_four_bytes_a_parameter(name):
    inv = catalog.inventory(name, dtype=torch.float32)
    assert {c.name: c.bytes for c in inv.models} == {k: 4 * n for k, n in catalog.parameter_count(name).items()}


def test_wan_keeps_its_fp32_modules_and_its_vae_in_float32():
    # WanTransformer3DModel._keep_in_fp32_modules (time_embedder, scale_shift_table, norm1-3) load in float32 at
    # bf16, 29,184,000 parameters of them; the model card loads the VAE in float32 beside a bf16 pipeline
    inv = catalog.inventory("wan2.1-t2v-14b")
    counts = catalog.parameter_count("wan2.1-t2v-14b")
    assert inv["transformer"].bytes == 2 * counts["transformer"] + 2 * 29_184_000
    assert inv["vae"].bytes == 4 * counts["vae"]
    assert inv["text_encoder"].bytes == 2 * counts["text_encoder"]


def test_sd3_transformer_counts_its_saved_position_table():
    # SD3's PatchEmbed saves its 192 x 192 x 2432 sin-cos table as a persistent buffer: it is in the checkpoint
    # and on the device, so it is in the bytes though not in the parameter count
    inv = catalog.inventory("sd3.5-large", dtype="float16")
    counts = catalog.parameter_count("sd3.5-large")
    assert inv["transformer"].bytes == 2 * (counts["transformer"] + 192 * 192 * 2432)


def test_inventories_are_cached_and_building_allocates_no_weights():
    catalog._skeleton.cache_clear()
    catalog._inventory.cache_clear()
    rss = psutil.Process().memory_info().rss
    first = catalog.inventory("qwen-image", dtype=torch.float16)
    # 29B parameters on the meta device: a real allocation would be tens of GB
    assert psutil.Process().memory_info().rss - rss < 1 << 30
    skeleton = catalog._skeleton("qwen-image", "text_encoder")
    assert all(t.is_meta for t in skeleton.state_dict(keep_vars=True).values())
    assert catalog.inventory("Qwen/Qwen-Image", dtype="float16") is first


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_plan_takes_a_catalog_inventory():
    # Flux.1-dev at bf16: its 22.2 GiB transformer fits neither 16 GiB GPU, and balanced says so by name; on two
    # 40 GiB GPUs it goes whole to one and the 8.9 GiB T5 encoder to the other
    inv = catalog.inventory("flux.1-dev")
    with pytest.raises(pipemap.DoesNotFitError, match="transformer"):
        pipemap.plan(inv, hardware="2x16GiB,cpu=64GiB", strategy="balanced")
    plan = pipemap.plan(inv, hardware="2x40GiB,cpu=64GiB", strategy="balanced")
    assert plan.device_map["transformer"] != plan.device_map["text_encoder_2"]


def test_run_catalog_prints_every_pipeline(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    assert catalog.run_catalog() == 0
    out = capsys.readouterr().out
    for name in catalog.names():
        assert name in out
    assert "22.17 GiB" in out  # the Flux transformer at bf16: 23,802,816,640 bytes


def test_inspect_takes_a_catalog_name():
    assert pipemap.inspect("black-forest-labs/FLUX.1-dev") == catalog.inventory("flux.1-dev")
    assert pipemap.inspect("flux-dev", dtype="float16")["transformer"].bytes == 2 * 11_901_408_320
