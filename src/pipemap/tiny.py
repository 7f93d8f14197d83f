"""Tiny diffusers pipelines built entirely in code, for tests, benchmarks and ``pipemap demo``.

Every component gets random weights from a small config, seeded with ``torch.manual_seed`` inside a forked RNG
(so building is deterministic and leaves the caller's global RNG untouched). Nothing is downloaded: the CLIP
tokenizer uses a byte-level vocabulary (the 256 GPT-2 byte symbols, the same with ``</w>``, plus the two special
tokens) and no merges. ``scale`` multiplies every channel width so benchmarks can build a mid-size pipeline.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .quiet import quiet_diffusers

KINDS = ("sd", "sdxl", "controlnet")  # UNet pipelines
ALL_KINDS = (*KINDS, "flux")  # and a transformer one with a T5 encoder
SEED = 0
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
VOCAB_SIZE = 514
MAX_LENGTH = 77
FLUX_TOKENS = 32  # the T5 sequence length of the tiny Flux-like pipeline
GROUPS = 8  # norm groups; divides every width (32 * scale, 64 * scale, their sums)


def _byte_symbols() -> list[str]:
    """The 256 GPT-2 byte-to-unicode symbols, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def tokenizer_vocab() -> dict[str, int]:
    """The 514-token byte-level vocabulary: bytes, bytes + ``</w>``, then BOS and EOS."""
    symbols = _byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + [BOS, EOS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    """A CLIPTokenizer over the byte-level vocabulary with no merges (pad = EOS, max length 77)."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
        Path(vocab).write_text(json.dumps(tokenizer_vocab()), encoding="utf-8")
        Path(merges).write_text("#version: 0.2\n", encoding="utf-8")
        return CLIPTokenizer(vocab, merges, pad_token=EOS, model_max_length=MAX_LENGTH)


def _seeded(make, seed: int = SEED):
    """Call ``make()`` under ``torch.manual_seed(seed)`` without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().eval()


def _text_encoder(scale: int, projection_dim: int | None = None):
    """A tiny CLIP text encoder (with a projection head when ``projection_dim`` is given)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    hidden = 32 * scale
    vocab = tokenizer_vocab()
    config = CLIPTextConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=4,
        num_hidden_layers=3,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_LENGTH,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[EOS],
        projection_dim=projection_dim or hidden,
    )
    if projection_dim is None:
        return CLIPTextModel(config)
    return CLIPTextModelWithProjection(config)


def _vae(scale: int):
    """A tiny AutoencoderKL (two blocks, so latents are half the image size)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(32 * scale, 64 * scale),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=GROUPS,
        sample_size=32,
    )


def _unet_kwargs(scale: int, cross_dim: int) -> dict:
    """Shared UNet / ControlNet config: 16x16 latents, heads of width 16 * scale."""
    return dict(
        block_out_channels=(32 * scale, 64 * scale),
        layers_per_block=1,
        in_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        cross_attention_dim=cross_dim,
        attention_head_dim=(2, 4),
        norm_num_groups=GROUPS,
    )


def _unet(scale: int, cross_dim: int, **extra):
    """A tiny UNet2DConditionModel."""
    from diffusers import UNet2DConditionModel

    kwargs = _unet_kwargs(scale, cross_dim)
    return UNet2DConditionModel(
        **kwargs, sample_size=16, out_channels=4, up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), **extra
    )


def _sd_scheduler():
    """A DDIM scheduler with the Stable Diffusion betas."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _sd_components(scale: int) -> dict:
    """Components shared by the SD and ControlNet pipelines."""
    return dict(
        unet=_seeded(lambda: _unet(scale, 32 * scale)),
        vae=_seeded(lambda: _vae(scale)),
        text_encoder=_seeded(lambda: _text_encoder(scale)),
        tokenizer=build_tokenizer(),
        scheduler=_sd_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_sd(scale: int = 1):
    """A tiny StableDiffusionPipeline (32x32 images)."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(**_sd_components(scale))


def build_sdxl(scale: int = 1):
    """A tiny StableDiffusionXLPipeline with two text encoders (32x32 images)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    hidden, time_dim = 32 * scale, 8
    unet = _seeded(
        lambda: _unet(
            scale,
            2 * hidden,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            projection_class_embeddings_input_dim=6 * time_dim + hidden,
            use_linear_projection=True,
        )
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1
    )
    return StableDiffusionXLPipeline(
        vae=_seeded(lambda: _vae(scale)),
        text_encoder=_seeded(lambda: _text_encoder(scale)),
        text_encoder_2=_seeded(lambda: _text_encoder(scale, projection_dim=hidden), SEED + 1),
        tokenizer=build_tokenizer(),
        tokenizer_2=build_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


def build_controlnet(scale: int = 1):
    """A tiny StableDiffusionControlNetPipeline whose ControlNet matches the SD unet."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    kwargs = _unet_kwargs(scale, 32 * scale)
    cond = (16 * scale, 32 * scale)  # one stride-2 step: 32x32 image -> 16x16 latents
    controlnet = _seeded(lambda: ControlNetModel(**kwargs, conditioning_embedding_out_channels=cond), SEED + 1)
    return StableDiffusionControlNetPipeline(controlnet=controlnet, **_sd_components(scale))


def build_t5_tokenizer():
    """A T5 tokenizer with no download: a unigram vocabulary of the printable ASCII characters and the word marker."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import T5TokenizerFast  # type: ignore[attr-defined, unused-ignore]  # transformers 5: an alias

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    vocab += [(chr(code), -1.0) for code in range(32, 127)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return T5TokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                           extra_ids=0, model_max_length=FLUX_TOKENS)


def build_flux(scale: int = 1):
    """A tiny Flux-like pipeline: a transformer denoiser, CLIP and T5 text encoders, a flow-matching scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_tokenizer()
    t5 = _seeded(lambda: T5EncoderModel(T5Config(vocab_size=99, d_model=32 * scale, d_kv=8 * scale, d_ff=37,
                                                 num_layers=2, num_heads=4, relative_attention_num_buckets=8)))
    transformer = _seeded(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16 * scale,
        num_attention_heads=2, joint_attention_dim=32 * scale, pooled_projection_dim=32 * scale,
        axes_dims_rope=[4 * scale, 6 * scale, 6 * scale]))
    vae = _seeded(lambda: AutoencoderKL(
        block_out_channels=[32 * scale, 32 * scale], in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, norm_num_groups=GROUPS,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035))
    clip = _seeded(lambda: _text_encoder(scale))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
                        tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=build_t5_tokenizer(),
                        transformer=transformer)


_BUILDERS = {"sd": build_sd, "sdxl": build_sdxl, "controlnet": build_controlnet, "flux": build_flux}


def build(kind: str, scale: int = 1):
    """Build the tiny pipeline of ``kind`` (one of ``KINDS``)."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {KINDS}")
    return _BUILDERS[kind](scale=scale)


def save(kind: str, path, variant_fp16: bool = True, scale: int = 1):
    """Build ``kind`` and save it to ``path`` (fp16 variant first, then fp32 so config.json says float32)."""
    pipe = build(kind, scale=scale)
    path = Path(path)
    if variant_fp16:
        with quiet_diffusers():  # silences the "modules to keep in float32" notice of ``.to(float16)``
            half = copy.deepcopy(pipe).to(torch.float16)
        half.save_pretrained(path, variant="fp16")
    pipe.save_pretrained(path)
    return path


def resolution(pipe) -> int:
    """The pipeline's default image side in pixels."""
    return pipe.unet.config.sample_size * pipe.vae_scale_factor


def control_image(pipe, seed: int = SEED) -> Image.Image:
    """A deterministic random RGB control image at the pipeline's default resolution."""
    side = resolution(pipe)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def default_call(pipe, kind: str, output_type: str = "np") -> dict:
    """Call kwargs for a fast deterministic run: 2 steps, CFG on, default resolution."""
    kwargs = dict(
        prompt="a tiny cat",
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type=output_type,
    )
    if kind == "controlnet":
        kwargs["image"] = control_image(pipe)
    if kind == "flux":  # no negative prompt: Flux is guidance-distilled; its default side is far from tiny
        kwargs.update(height=32, width=32, max_sequence_length=FLUX_TOKENS)
    return kwargs
