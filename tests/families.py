"""Tiny pipelines of many diffusers families, built in code from diffusers' own classes with tiny configs.

Modelled on the components of diffusers' fast tests (``get_dummy_components``), but nothing is downloaded: the
text encoders are built from configs, and the tokenizers in code (``pipemap.tiny``'s byte-level CLIP and T5
tokenizers, and unigram tokenizers over printable ASCII for Gemma, Llama, Qwen2 and BERT). Gemma, Qwen2 and BERT
get transformers' generic fast tokenizer: their own classes rebuild a different backend when loaded back.
Each builder returns ``(pipeline, call_kwargs)``: a small deterministic call (1-2 steps, tiny sizes, a seeded
generator, tensor output). Pass ``fresh(call_kwargs)`` to each run: a run consumes its generator.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from pipemap import tiny

T5_VOCAB = 99  # pipemap.tiny's T5 tokenizer: 4 specials + the word marker + 95 printable characters
SEQ = 16  # text sequence length wherever a pipeline lets us choose it


def _seeded(make, seed: int = 0):
    """Build under a fixed seed, in eval mode (a real load leaves models in eval mode), keeping the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = make()
        return module.eval() if isinstance(module, torch.nn.Module) else module


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def _pil(side: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode=mode)


def _image_tensor(side: int, seed: int = 0) -> torch.Tensor:
    """A (1, 3, side, side) image in [0, 1]."""
    return torch.from_numpy(np.random.default_rng(seed).random((1, 3, side, side), dtype=np.float32))


def _half_mask(side: int) -> Image.Image:
    """A mask covering the lower-right quarter (white = repaint)."""
    pixels = np.zeros((side, side), dtype=np.uint8)
    pixels[side // 2:, side // 2:] = 255
    return Image.fromarray(pixels, mode="L")


# ---- tokenizers and text encoders ---------------------------------------------------------------------------------


def unigram_tokenizer(cls, specials: dict[str, str], max_length: int, extra: tuple[str, ...] = ()):
    """A ``cls`` tokenizer over a unigram vocabulary: the special tokens, ``extra`` pieces, the word marker and the
    printable ASCII characters. ``specials`` maps keyword (``pad_token``...) to token; the first is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = list(dict.fromkeys([*specials.values(), *extra]))
    vocab = [(p, 0.0) for p in pieces] + [("\u2581", -1.0)] + [(chr(c), -1.0) for c in range(32, 127)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=pieces.index(specials["unk_token"])))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return cls(tokenizer_object=backend, model_max_length=max_length, **specials)


def clip_text(hidden: int = 32, projection: bool = False, layers: int = 2, positions: int = tiny.MAX_LENGTH):
    """A tiny CLIP text encoder matching pipemap.tiny's byte-level CLIP tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tiny.tokenizer_vocab()
    config = CLIPTextConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                            num_hidden_layers=layers, vocab_size=tiny.VOCAB_SIZE, max_position_embeddings=positions,
                            bos_token_id=vocab[tiny.BOS], eos_token_id=vocab[tiny.EOS], pad_token_id=vocab[tiny.EOS],
                            projection_dim=hidden, hidden_act="gelu")
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def t5(d_model: int = 32, layers: int = 2, umt5: bool = False):
    """A tiny T5 (or UMT5) encoder matching pipemap.tiny's T5 tokenizer."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model_cls(config_cls(vocab_size=T5_VOCAB, d_model=d_model, d_kv=8, d_ff=37, num_layers=layers,
                                num_heads=4, relative_attention_num_buckets=8))


def t5_tokenizer(max_length: int = 256):
    tokenizer = tiny.build_t5_tokenizer()
    tokenizer.model_max_length = max_length
    return tokenizer


def gemma(hidden: int = 8, layers: int = 1):
    """A tiny Gemma2 model and its tokenizer (built in code)."""
    from transformers import Gemma2Config, Gemma2Model, PreTrainedTokenizerFast

    specials = dict(pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tokenizer = unigram_tokenizer(PreTrainedTokenizerFast, specials, 256)
    config = Gemma2Config(head_dim=4, hidden_size=hidden, intermediate_size=16, num_attention_heads=2,
                          num_hidden_layers=layers, num_key_value_heads=2, vocab_size=len(tokenizer),
                          max_position_embeddings=512, sliding_window=4, pad_token_id=0, attn_implementation="eager")
    return _seeded(lambda: Gemma2Model(config)), tokenizer


def _aekl(latent: int = 4, blocks=(4,), groups: int = 1, **extra):
    from diffusers import AutoencoderKL

    n = len(blocks)
    return _seeded(lambda: AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=blocks, layers_per_block=1, latent_channels=latent,
        norm_num_groups=groups, down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        sample_size=32, **extra))


def _flow_vae(latent: int):
    """The SD3/Flux-style tiny VAE (one block: latents at image size) with shift and scaling factors."""
    return _aekl(latent, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)


# ---- UNet families ------------------------------------------------------------------------------------------------


def _sd_unet(in_channels: int = 4, **extra):
    from diffusers import UNet2DConditionModel

    kwargs = dict(block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=in_channels,
                  out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=4,
                  attention_head_dim=2)
    kwargs.update(extra)
    return _seeded(lambda: UNet2DConditionModel(**kwargs))


def _sd_parts(in_channels: int = 4) -> dict:
    from diffusers import PNDMScheduler

    return dict(unet=_sd_unet(in_channels), scheduler=PNDMScheduler(skip_prk_steps=True),
                vae=_aekl(4, (8, 16), groups=4), text_encoder=_seeded(clip_text), tokenizer=tiny.build_tokenizer(),
                safety_checker=None, feature_extractor=None, image_encoder=None, requires_safety_checker=False)


def _text_call(**extra) -> dict:
    return dict(prompt="a tiny cat", generator=_generator(), num_inference_steps=2, **extra)


def sd_img2img():
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe = StableDiffusionImg2ImgPipeline(**_sd_parts())
    return pipe, _text_call(image=_image_tensor(32), strength=0.8, guidance_scale=6.0, output_type="pt")


def sd_inpaint():
    from diffusers import StableDiffusionInpaintPipeline

    pipe = StableDiffusionInpaintPipeline(**_sd_parts(in_channels=9))
    return pipe, _text_call(image=_pil(32), mask_image=_half_mask(32), height=32, width=32, guidance_scale=6.0,
                            output_type="pt")


def _sdxl_parts(in_channels: int = 4) -> dict:
    from diffusers import EulerDiscreteScheduler

    unet = _sd_unet(in_channels, use_linear_projection=True, addition_embed_type="text_time",
                    addition_time_embed_dim=8, projection_class_embeddings_input_dim=5 * 8 + 32,
                    cross_attention_dim=64)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                       beta_schedule="scaled_linear", timestep_spacing="leading")
    return dict(unet=unet, scheduler=scheduler, vae=_aekl(4, (8, 16), groups=4), text_encoder=_seeded(clip_text),
                tokenizer=tiny.build_tokenizer(), text_encoder_2=_seeded(lambda: clip_text(projection=True), 1),
                tokenizer_2=tiny.build_tokenizer(), requires_aesthetics_score=True, image_encoder=None,
                feature_extractor=None)


def sdxl_img2img():
    from diffusers import StableDiffusionXLImg2ImgPipeline

    pipe = StableDiffusionXLImg2ImgPipeline(**_sdxl_parts(), add_watermarker=False)
    return pipe, _text_call(image=_image_tensor(32), strength=0.8, guidance_scale=5.0, output_type="pt")


def sdxl_inpaint():
    from diffusers import StableDiffusionXLInpaintPipeline

    pipe = StableDiffusionXLInpaintPipeline(**_sdxl_parts(), add_watermarker=False)
    return pipe, _text_call(image=_pil(32), mask_image=_half_mask(32), height=32, width=32, strength=1.0,
                            guidance_scale=6.0, output_type="pt")


def lcm():
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler

    parts = _sd_parts()
    parts["unet"] = _sd_unet(time_cond_proj_dim=32)
    parts["scheduler"] = LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                      clip_sample=False, set_alpha_to_one=False)
    return LatentConsistencyModelPipeline(**parts), _text_call(guidance_scale=6.0, height=32, width=32,
                                                               output_type="pt")


def _movq():
    from diffusers import VQModel

    return _seeded(lambda: VQModel(
        block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"], in_channels=3,
        latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial", num_vq_embeddings=12,
        out_channels=3, up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"], vq_embed_dim=4))


def kandinsky22():
    from diffusers import DDIMScheduler, KandinskyV22Pipeline, UNet2DConditionModel

    unet = _seeded(lambda: UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(16, 32), layers_per_block=1,
        encoder_hid_dim=32, encoder_hid_dim_type="image_proj", cross_attention_dim=32, attention_head_dim=4,
        resnet_time_scale_shift="scale_shift", class_embed_type=None, norm_num_groups=8))
    scheduler = DDIMScheduler(beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon", thresholding=False)
    rng = np.random.default_rng(0)
    embeds = [torch.from_numpy(rng.standard_normal((1, 32), dtype=np.float32)) for _ in range(2)]
    return KandinskyV22Pipeline(unet=unet, scheduler=scheduler, movq=_movq()), dict(
        image_embeds=embeds[0], negative_image_embeds=embeds[1], generator=_generator(), height=32, width=32,
        guidance_scale=4.0, num_inference_steps=2, output_type="pt")


def kandinsky3():
    from diffusers import DDPMScheduler, Kandinsky3Pipeline, Kandinsky3UNet

    unet = _seeded(lambda: Kandinsky3UNet(in_channels=4, time_embedding_dim=4, groups=2, attention_head_dim=4,
                                          layers_per_block=3, block_out_channels=(32, 64), cross_attention_dim=4,
                                          encoder_hid_dim=32))
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="squaredcos_cap_v2",
                              clip_sample=True, thresholding=False)
    pipe = Kandinsky3Pipeline(unet=unet, scheduler=scheduler, movq=_movq(), text_encoder=_seeded(t5),
                              tokenizer=t5_tokenizer(128))
    return pipe, _text_call(guidance_scale=6.0, height=16, width=16, output_type="pt")


def deepfloyd_if():
    from diffusers import DDPMScheduler, IFPipeline, UNet2DConditionModel
    from diffusers.pipelines.deepfloyd_if import IFWatermarker

    unet = _seeded(lambda: UNet2DConditionModel(
        sample_size=16, layers_per_block=1, block_out_channels=[16, 32],
        down_block_types=["ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"],
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", up_block_types=["SimpleCrossAttnUpBlock2D",
                                                                        "ResnetUpsampleBlock2D"],
        in_channels=3, out_channels=6, cross_attention_dim=32, encoder_hid_dim=32, attention_head_dim=8,
        addition_embed_type="text", addition_embed_type_num_heads=2, cross_attention_norm="group_norm",
        resnet_time_scale_shift="scale_shift", act_fn="gelu", norm_num_groups=8))
    scheduler = DDPMScheduler(beta_schedule="squaredcos_cap_v2", beta_start=0.0001, beta_end=0.02, thresholding=True,
                              dynamic_thresholding_ratio=0.95, sample_max_value=1.0, prediction_type="epsilon",
                              variance_type="learned_range")
    pipe = IFPipeline(tokenizer=t5_tokenizer(77), text_encoder=_seeded(t5), unet=unet, scheduler=scheduler,
                      watermarker=_seeded(IFWatermarker), safety_checker=None, feature_extractor=None,
                      requires_safety_checker=False)
    return pipe, _text_call(height=16, width=16, output_type="pt")


def stable_video_diffusion():
    from diffusers import (
        AutoencoderKLTemporalDecoder,
        EulerDiscreteScheduler,
        StableVideoDiffusionPipeline,
        UNetSpatioTemporalConditionModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    unet = _seeded(lambda: UNetSpatioTemporalConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=8, out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), cross_attention_dim=16,
        num_attention_heads=(2, 4), projection_class_embeddings_input_dim=3 * 8, addition_time_embed_dim=8))
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", interpolation_type="linear",
        prediction_type="v_prediction", sigma_max=700.0, sigma_min=0.002, steps_offset=1, timestep_spacing="leading",
        timestep_type="continuous", use_karras_sigmas=True)
    vae = _seeded(lambda: AutoencoderKLTemporalDecoder(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                                                       down_block_types=["DownEncoderBlock2D"] * 2, latent_channels=4,
                                                       layers_per_block=1))
    encoder = _seeded(lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, projection_dim=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=32, patch_size=8)))
    pipe = StableVideoDiffusionPipeline(unet=unet, image_encoder=encoder, scheduler=scheduler, vae=vae,
                                        feature_extractor=CLIPImageProcessor(crop_size=32, size=32))
    return pipe, dict(image=_image_tensor(32), generator=_generator(), num_inference_steps=2, output_type="pt",
                      min_guidance_scale=1.0, max_guidance_scale=2.5, num_frames=2, height=32, width=32,
                      decode_chunk_size=2)


# ---- transformer image families -----------------------------------------------------------------------------------


def _flux_parts(in_channels: int, out_channels: int | None, latent: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    transformer = _seeded(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=in_channels, out_channels=out_channels, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8]))
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=_seeded(clip_text),
                text_encoder_2=_seeded(t5), tokenizer=tiny.build_tokenizer(), tokenizer_2=t5_tokenizer(),
                transformer=transformer, vae=_flow_vae(latent))


def flux_fill():
    from diffusers import FluxFillPipeline

    pipe = FluxFillPipeline(**_flux_parts(in_channels=20, out_channels=8, latent=2))
    return pipe, _text_call(image=_image_tensor(32), mask_image=_half_mask(32), guidance_scale=5.0, height=32,
                            width=32, max_sequence_length=SEQ, output_type="pt")


def flux_kontext():
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline(**_flux_parts(in_channels=4, out_channels=None, latent=1), image_encoder=None,
                               feature_extractor=None)
    return pipe, _text_call(image=_pil(32), guidance_scale=5.0, height=8, width=8, max_area=64,
                            max_sequence_length=SEQ, output_type="pt", _auto_resize=False)


def sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = _seeded(lambda: SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4))
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer, vae=_flow_vae(4),
        text_encoder=_seeded(lambda: clip_text(projection=True)), tokenizer=tiny.build_tokenizer(),
        text_encoder_2=_seeded(lambda: clip_text(projection=True), 1), tokenizer_2=tiny.build_tokenizer(),
        text_encoder_3=_seeded(t5), tokenizer_3=t5_tokenizer(), image_encoder=None, feature_extractor=None)
    return pipe, _text_call(guidance_scale=5.0, height=32, width=32, max_sequence_length=SEQ, output_type="pt")


def pixart_sigma():
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    transformer = _seeded(lambda: PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6))
    pipe = PixArtSigmaPipeline(transformer=transformer, vae=_aekl(4, (8, 16), groups=4), scheduler=DDIMScheduler(),
                               text_encoder=_seeded(t5), tokenizer=t5_tokenizer())
    return pipe, _text_call(guidance_scale=5.0, height=16, width=16, use_resolution_binning=False,
                            max_sequence_length=SEQ, output_type="pt")


def sana():
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    transformer = _seeded(lambda: SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
        sample_size=32))
    vae = _seeded(lambda: AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407))
    text_encoder, tokenizer = gemma()
    pipe = SanaPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                        text_encoder=text_encoder, tokenizer=tokenizer)
    return pipe, _text_call(negative_prompt="", guidance_scale=6.0, height=32, width=32, max_sequence_length=SEQ,
                            complex_human_instruction=None, use_resolution_binning=False, output_type="pt")


def aura_flow():
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler

    transformer = _seeded(lambda: AuraFlowTransformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        out_channels=4, pos_embed_max_size=256))
    pipe = AuraFlowPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer,
                            vae=_aekl(4, (8, 16), groups=4), text_encoder=_seeded(lambda: t5(umt5=True)),
                            tokenizer=t5_tokenizer())
    return pipe, _text_call(guidance_scale=5.0, height=32, width=32, max_sequence_length=SEQ, output_type="pt")


def lumina2():
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    transformer = _seeded(lambda: Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=2, num_attention_heads=1,
        num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
        axes_dim_rope=[4, 2, 2], cap_feat_dim=8))
    text_encoder, tokenizer = gemma(layers=2)
    pipe = Lumina2Pipeline(transformer=transformer, vae=_flow_vae(4), scheduler=FlowMatchEulerDiscreteScheduler(),
                           text_encoder=text_encoder, tokenizer=tokenizer)
    return pipe, _text_call(guidance_scale=5.0, height=32, width=32, max_sequence_length=SEQ, output_type="pt")


def hunyuan_dit():
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    transformer = _seeded(lambda: HunyuanDiT2DModel(
        sample_size=16, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, in_channels=4,
        cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16, hidden_size=24,
        activation_fn="gelu-approximate"))
    specials = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tokenizer = unigram_tokenizer(PreTrainedTokenizerFast, specials, 77)
    bert = _seeded(lambda: BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=37,
                                                max_position_embeddings=128), add_pooling_layer=False))
    pipe = HunyuanDiTPipeline(transformer=transformer, vae=_aekl(4, (8, 16), groups=4), scheduler=DDPMScheduler(),
                              text_encoder=bert, tokenizer=tokenizer, text_encoder_2=_seeded(t5),
                              tokenizer_2=t5_tokenizer(), safety_checker=None, feature_extractor=None,
                              requires_safety_checker=False)
    return pipe, _text_call(guidance_scale=5.0, height=16, width=16, use_resolution_binning=False, output_type="pt")


def qwen_image():
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    transformer = _seeded(lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)))
    vae = _seeded(lambda: AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4))
    specials = dict(pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer = unigram_tokenizer(PreTrainedTokenizerFast, specials, 1024, extra=("<|im_start|>",))
    vocab = len(tokenizer) + 3  # the three vision tokens follow the text vocabulary
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=vocab, rope_theta=1000000.0,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=vocab, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 2,
        vision_token_id=vocab - 1)
    text_encoder = _seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))
    pipe = QwenImagePipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                             text_encoder=text_encoder, tokenizer=tokenizer)
    return pipe, _text_call(negative_prompt="bad quality", guidance_scale=3.0, true_cfg_scale=1.0, height=32,
                            width=32, max_sequence_length=SEQ, output_type="pt")


def hidream():
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizerFast

    transformer = _seeded(lambda: HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=1, caption_channels=[32, 16], text_emb_dim=64, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1)))
    specials = dict(pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    tokenizer_4 = unigram_tokenizer(LlamaTokenizerFast, specials, 128)
    llama = _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer_4), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, bos_token_id=2, eos_token_id=1)))
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_flow_vae(4),
        text_encoder=_seeded(lambda: clip_text(projection=True)), tokenizer=tiny.build_tokenizer(),
        text_encoder_2=_seeded(lambda: clip_text(projection=True), 1), tokenizer_2=tiny.build_tokenizer(),
        text_encoder_3=_seeded(t5), tokenizer_3=t5_tokenizer(), text_encoder_4=llama, tokenizer_4=tokenizer_4,
        transformer=transformer)
    # HiDream rescales any size to its default area, (128 * vae_scale_factor) ** 2, so latents are always 128x128
    # (4096 tokens): one step without guidance keeps it cheap
    return pipe, dict(prompt="a tiny cat", generator=_generator(), num_inference_steps=1, guidance_scale=1.0,
                      max_sequence_length=SEQ, output_type="pt")


def _cascade_clip():
    return _seeded(lambda: clip_text(hidden=32, projection=True))


def stable_cascade_prior():
    from diffusers import DDPMWuerstchenScheduler, StableCascadePriorPipeline, StableCascadeUNet

    prior = _seeded(lambda: StableCascadeUNet(
        conditioning_dim=32, block_out_channels=(32, 32), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1),
        up_num_layers_per_block=(1, 1), switch_level=(False,), clip_image_in_channels=32, clip_text_in_channels=32,
        clip_text_pooled_in_channels=32, dropout=(0.1, 0.1), in_channels=16, out_channels=16))
    pipe = StableCascadePriorPipeline(prior=prior, text_encoder=_cascade_clip(), tokenizer=tiny.build_tokenizer(),
                                      scheduler=DDPMWuerstchenScheduler(), feature_extractor=None, image_encoder=None)
    return pipe, _text_call(guidance_scale=4.0, height=128, width=128, output_type="pt")


def stable_cascade_decoder():
    from diffusers import DDPMWuerstchenScheduler, StableCascadeDecoderPipeline, StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen import PaellaVQModel

    decoder = _seeded(lambda: StableCascadeUNet(
        in_channels=4, out_channels=4, conditioning_dim=32, block_out_channels=[8, 16], num_attention_heads=[-1, 2],
        down_num_layers_per_block=[1, 1], up_num_layers_per_block=[1, 1], down_blocks_repeat_mappers=[1, 1],
        up_blocks_repeat_mappers=[2, 2], block_types_per_layer=[["SDCascadeResBlock", "SDCascadeTimestepBlock"],
                                                                ["SDCascadeResBlock", "SDCascadeTimestepBlock",
                                                                 "SDCascadeAttnBlock"]],
        switch_level=None, clip_text_pooled_in_channels=32, effnet_in_channels=4, dropout=[0.1, 0.1]))
    vqgan = _seeded(lambda: PaellaVQModel(bottleneck_blocks=1, num_vq_embeddings=2, levels=2, embed_dim=32))
    pipe = StableCascadeDecoderPipeline(decoder=decoder, vqgan=vqgan, text_encoder=_cascade_clip(),
                                        tokenizer=tiny.build_tokenizer(), scheduler=DDPMWuerstchenScheduler(),
                                        latent_dim_scale=4.0)
    embeddings = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 4, 4, 4), dtype=np.float32))
    return pipe, _text_call(image_embeddings=embeddings, guidance_scale=2.0, output_type="pt")


def shap_e():
    from diffusers import HeunDiscreteScheduler, PriorTransformer, ShapEPipeline
    from diffusers.pipelines.shap_e import ShapERenderer

    prior = _seeded(lambda: PriorTransformer(
        num_attention_heads=2, attention_head_dim=16, embedding_dim=16, num_embeddings=32, embedding_proj_dim=16,
        time_embed_dim=64, num_layers=1, clip_embed_dim=32, additional_embeddings=0, time_embed_act_fn="gelu",
        norm_in_type="layer", encoder_hid_proj_type=None, added_emb_type=None))
    renderer = _seeded(lambda: ShapERenderer(param_shapes=((8, 93), (8, 8), (8, 8), (8, 8)), d_latent=16,
                                             d_hidden=8, n_output=12, background=(0.1, 0.1, 0.1)))
    scheduler = HeunDiscreteScheduler(beta_schedule="exp", num_train_timesteps=1024, prediction_type="sample",
                                      use_karras_sigmas=True, clip_sample=True, clip_sample_range=1.0)
    pipe = ShapEPipeline(prior=prior, text_encoder=_seeded(lambda: clip_text(hidden=16, projection=True)),
                         tokenizer=tiny.build_tokenizer(), shap_e_renderer=renderer, scheduler=scheduler)
    return pipe, dict(prompt="a tiny cat", generator=_generator(), num_inference_steps=1, frame_size=8,
                      output_type="latent")


# ---- video families -----------------------------------------------------------------------------------------------


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return _seeded(lambda: AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                            temperal_downsample=[False, True, True]))


def _wan_transformer(seed: int = 0, **extra):
    from diffusers import WanTransformer3DModel

    return _seeded(lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, out_channels=16, text_dim=32,
        freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, **extra), seed)


def _video_call(**extra) -> dict:
    return _text_call(negative_prompt="negative", max_sequence_length=SEQ, output_type="pt", **extra)


def wan_t2v():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline(transformer=_wan_transformer(in_channels=16), vae=_wan_vae(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=_seeded(t5),
                       tokenizer=t5_tokenizer(), transformer_2=None)
    return pipe, _video_call(guidance_scale=6.0, height=16, width=16, num_frames=5)


def wan_i2v():
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    encoder = _seeded(lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=1)))
    pipe = WanImageToVideoPipeline(
        transformer=_wan_transformer(in_channels=36, image_dim=4), vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=_seeded(t5), tokenizer=t5_tokenizer(),
        image_encoder=encoder, image_processor=CLIPImageProcessor(crop_size=32, size=32), transformer_2=None)
    return pipe, _video_call(image=_pil(16), guidance_scale=6.0, height=16, width=16, num_frames=5)


def ltx():
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    transformer = _seeded(lambda: LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=1, caption_channels=32))

    def make_vae():
        vae = AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
            upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
            patch_size_t=1, encoder_causal=True, decoder_causal=False)
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        return vae

    pipe = LTXPipeline(transformer=transformer, vae=_seeded(make_vae), scheduler=FlowMatchEulerDiscreteScheduler(),
                       text_encoder=_seeded(t5), tokenizer=t5_tokenizer(128))
    return pipe, _video_call(guidance_scale=3.0, height=32, width=32, num_frames=9)


def cogvideox():
    from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel, DDIMScheduler

    transformer = _seeded(lambda: CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=1, sample_width=2, sample_height=2, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=SEQ))
    vae = _seeded(lambda: AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4))
    pipe = CogVideoXPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler(), text_encoder=_seeded(t5),
                             tokenizer=t5_tokenizer(226))
    return pipe, _video_call(guidance_scale=6.0, height=16, width=16, num_frames=8)


def latte():
    from diffusers import DDIMScheduler, LattePipeline, LatteTransformer3DModel

    transformer = _seeded(lambda: LatteTransformer3DModel(
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6))
    pipe = LattePipeline(transformer=transformer, vae=_aekl(4, (8, 16), groups=4), scheduler=DDIMScheduler(),
                         text_encoder=_seeded(t5), tokenizer=t5_tokenizer(120))
    return pipe, _text_call(negative_prompt="low quality", guidance_scale=5.0, height=16, width=16, video_length=1,
                            output_type="pt", clean_caption=False)


def mochi():
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    def make_transformer():
        model = MochiTransformer3DModel(
            patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
            in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=4,
            activation_fn="swiglu", max_sequence_length=SEQ)
        model.pos_frequencies.data = model.pos_frequencies.new_full(model.pos_frequencies.shape, 0)
        return model

    vae = _seeded(lambda: AutoencoderKLMochi(latent_channels=12, out_channels=3,
                                             encoder_block_out_channels=(32,) * 4,
                                             decoder_block_out_channels=(32,) * 4,
                                             layers_per_block=(1, 1, 1, 1, 1)))
    pipe = MochiPipeline(transformer=_seeded(make_transformer), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                         text_encoder=_seeded(t5), tokenizer=t5_tokenizer())
    return pipe, _video_call(guidance_scale=4.5, height=16, width=16, num_frames=7)


# ---- families of the dry run's failure classes (issue 28) --------------------------------------------------------
# Each from diffusers' fast tests' get_dummy_components, tokenizers built in code.


def kandinsky22_inpaint():
    """Deep-copies its mask on the device (``prepare_mask``)."""
    from diffusers import KandinskyV22InpaintPipeline

    base, call = kandinsky22()
    unet = _seeded(lambda: _kandinsky_unet(9, "image", "image_proj"))
    mask = np.zeros((16, 16), dtype=np.float32)
    mask[:8, :8] = 1
    pipe = KandinskyV22InpaintPipeline(unet=unet, scheduler=base.scheduler, movq=base.movq)
    return pipe, {**call, "image": _pil(16), "mask_image": mask, "height": 16, "width": 16}


def _kandinsky_unet(in_channels: int, addition_embed_type: str, encoder_hid_dim_type: str):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        in_channels=in_channels, out_channels=8, addition_embed_type=addition_embed_type,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(16, 32), layers_per_block=1,
        encoder_hid_dim=32, encoder_hid_dim_type=encoder_hid_dim_type, cross_attention_dim=32, attention_head_dim=4,
        resnet_time_scale_shift="scale_shift", class_embed_type=None, norm_num_groups=8)


def skyreels_df():
    """SkyReels-V2 diffusion forcing: deep-copies its scheduler (timesteps on the device) for every latent frame."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    transformer = _seeded(lambda: SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32))
    pipe = SkyReelsV2DiffusionForcingPipeline(
        transformer=transformer, vae=_wan_vae(), text_encoder=_seeded(t5), tokenizer=t5_tokenizer(),
        scheduler=UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True))
    return pipe, _video_call(guidance_scale=6.0, height=16, width=16, num_frames=9)


def stable_audio():
    """Its VAE (Oobleck) uses ``weight_norm``; its scheduler seeds a Brownian tree with ``randint(...).item()``."""
    from diffusers import (
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )

    transformer = _seeded(lambda: StableAudioDiTModel(
        sample_size=4, in_channels=3, num_layers=2, attention_head_dim=4, num_key_value_attention_heads=2,
        out_channels=3, cross_attention_dim=4, time_proj_dim=8, global_states_input_dim=8,
        cross_attention_input_dim=4))
    scheduler = CosineDPMSolverMultistepScheduler(solver_order=2, prediction_type="v_prediction", sigma_data=1.0,
                                                  sigma_schedule="exponential")
    projection = _seeded(lambda: StableAudioProjectionModel(text_encoder_dim=32, conditioning_dim=4, min_value=0,
                                                            max_value=32))
    pipe = StableAudioPipeline(transformer=transformer, scheduler=scheduler, vae=_oobleck(decoder_input_channels=3),
                               text_encoder=_seeded(t5), tokenizer=t5_tokenizer(25), projection_model=projection)
    return pipe, dict(prompt="a hammer", generator=_generator(), num_inference_steps=2, guidance_scale=6.0,
                      output_type="pt")


def _oobleck(decoder_input_channels: int):
    from diffusers import AutoencoderOobleck

    return _seeded(lambda: AutoencoderOobleck(
        encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=3,
        decoder_input_channels=decoder_input_channels, audio_channels=2, channel_multiples=[2, 4], sampling_rate=4))


def longcat_audio():
    """LongCat AudioDiT: its VAE uses ``weight_norm``; it makes its own scheduler (``scheduler=None``), so its folder
    has no scheduler subfolder."""
    from diffusers import LongCatAudioDiTPipeline, LongCatAudioDiTTransformer, LongCatAudioDiTVae
    from transformers import UMT5Config, UMT5EncoderModel

    text_encoder = _seeded(lambda: UMT5EncoderModel(UMT5Config(d_model=32, num_layers=1, num_heads=4, d_ff=64,
                                                               vocab_size=T5_VOCAB)))
    transformer = _seeded(lambda: LongCatAudioDiTTransformer(dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32,
                                                             latent_dim=8, text_conv=False))
    vae = _seeded(lambda: LongCatAudioDiTVae(in_channels=1, channels=16, c_mults=[1, 2], strides=[2], latent_dim=8,
                                             encoder_latent_dim=16, downsampling_ratio=2, sample_rate=24000))
    pipe = LongCatAudioDiTPipeline(vae=vae, text_encoder=text_encoder, tokenizer=t5_tokenizer(),
                                   transformer=transformer)
    return pipe, dict(prompt="soft ocean", audio_duration_s=0.1, num_inference_steps=2, guidance_scale=1.0,
                      generator=_generator(), output_type="pt")


def anyflow_far():
    """AnyFlow FAR: attention through FlexAttention block masks, a kernel that refuses stand-in devices."""
    from diffusers import AnyFlowFARPipeline, AnyFlowFARTransformer3DModel, FlowMapEulerDiscreteScheduler

    transformer = _seeded(lambda: AnyFlowFARTransformer3DModel(
        patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3, num_attention_heads=2,
        attention_head_dim=12, in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r", chunk_partition=(1, 1, 1)))
    pipe = AnyFlowFARPipeline(transformer=transformer, vae=_wan_vae(), text_encoder=_seeded(t5),
                              scheduler=FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0),
                              tokenizer=t5_tokenizer())
    return pipe, _video_call(guidance_scale=6.0, height=16, width=16, num_frames=9)


def motif_i2v():
    """Motif-Video image-to-video: encodes the first frame with ``text_encoder.vision_tower``, a submodule of its
    text encoder called directly."""
    from diffusers import (
        AdaptiveProjectedGuidance,
        FlowMatchEulerDiscreteScheduler,
        MotifVideoImage2VideoPipeline,
        MotifVideoTransformer3DModel,
    )
    from transformers import SiglipImageProcessor, SiglipVisionConfig, T5Gemma2EncoderConfig, T5Gemma2TextConfig
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2Encoder

    text = T5Gemma2TextConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                              vocab_size=T5_VOCAB, max_position_embeddings=128, head_dim=16, num_key_value_heads=2,
                              dropout_rate=0.0)
    vision = SiglipVisionConfig(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                image_size=16, patch_size=4, num_channels=3)
    encoder = _seeded(lambda: T5Gemma2Encoder(T5Gemma2EncoderConfig(text_config=text, vision_config=vision)))
    transformer = _seeded(lambda: MotifVideoTransformer3DModel(
        in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=1,
        num_single_layers=1, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=32,
        image_embed_dim=4, rope_axes_dim=(4, 4, 4)))
    processor = SiglipImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": 16, "width": 16})
    pipe = MotifVideoImage2VideoPipeline(
        transformer=transformer, vae=_wan_vae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=encoder, tokenizer=t5_tokenizer(), feature_extractor=processor, guider=AdaptiveProjectedGuidance())
    return pipe, _text_call(image=_pil(16), negative_prompt="bad", height=16, width=16, num_frames=9,
                            max_sequence_length=SEQ, output_type="pt")


def audioldm2():
    """AudioLDM 2: encodes the prompt with its CLAP text encoder's ``get_text_features``, a method that calls the
    encoder's submodules (``text_model``, ``text_projection``) past the hook at its root."""
    from diffusers import AudioLDM2Pipeline, AudioLDM2ProjectionModel, AudioLDM2UNet2DConditionModel, DDIMScheduler
    from transformers import (
        ClapConfig,
        ClapFeatureExtractor,
        ClapModel,
        GPT2Config,
        GPT2LMHeadModel,
        RobertaTokenizer,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
    )

    unet = _seeded(lambda: AudioLDM2UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=8, sample_size=32, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=(8, 16)))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False)
    vae = _seeded(lambda: _aekl_audio())
    # a byte-level RoBERTa tokenizer with no merges (the pipeline asks for a RobertaTokenizer by class)
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<s>", "</s>", "<mask>", *tiny._byte_symbols()])}
    tokenizer = RobertaTokenizer(vocab=vocab, merges=[], model_max_length=77)
    text = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0, hidden_size=8, intermediate_size=37,
                layer_norm_eps=1e-05, num_attention_heads=1, num_hidden_layers=1, vocab_size=len(vocab),
                projection_dim=8)
    audio = dict(spec_size=8, window_size=4, num_mel_bins=8, intermediate_size=37, layer_norm_eps=1e-05,
                 depths=[1, 1], num_attention_heads=[1, 1], num_hidden_layers=1, hidden_size=192, projection_dim=8,
                 patch_size=2, patch_stride=2, patch_embed_input_channels=4)
    clap = _seeded(lambda: ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=16)))
    t5_2 = _seeded(lambda: t5(layers=1))

    def language_model():
        model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_head=1, n_layer=1, vocab_size=1000, n_ctx=99, n_positions=99))
        model.config.max_new_tokens = 8
        return model

    projection = _seeded(lambda: AudioLDM2ProjectionModel(text_encoder_dim=16, text_encoder_1_dim=32,
                                                          langauge_model_dim=16))
    vocoder = _seeded(lambda: SpeechT5HifiGan(SpeechT5HifiGanConfig(
        model_in_dim=8, sampling_rate=16000, upsample_initial_channel=16, upsample_rates=[2, 2],
        upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3, 7], resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]],
        normalize_before=False)))
    pipe = AudioLDM2Pipeline(unet=unet, scheduler=scheduler, vae=vae, text_encoder=clap, text_encoder_2=t5_2,
                             tokenizer=tokenizer, tokenizer_2=t5_tokenizer(77), language_model=_seeded(language_model),
                             feature_extractor=ClapFeatureExtractor(hop_length=7900), projection_model=projection,
                             vocoder=vocoder)
    return pipe, dict(prompt="a hammer", generator=_generator(), num_inference_steps=2, guidance_scale=6.0,
                      output_type="pt")


def _aekl_audio():
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=[8, 16], in_channels=1, out_channels=1, norm_num_groups=8,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                         latent_channels=4)


def sd_sde():
    """Stable Diffusion with the DPM++ SDE scheduler, which seeds its noise with ``torch.randint(...).item()``."""
    from diffusers import DPMSolverSDEScheduler, StableDiffusionPipeline

    parts = _sd_parts()
    parts["scheduler"] = DPMSolverSDEScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                               use_karras_sigmas=True)
    return StableDiffusionPipeline(**parts), _text_call(guidance_scale=6.0, height=32, width=32, output_type="pt")


def _visualcloze_parts() -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    transformer = _seeded(lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=12, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=6,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[2, 2, 2]))
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=_seeded(clip_text),
                text_encoder_2=_seeded(t5), tokenizer=tiny.build_tokenizer(), tokenizer_2=t5_tokenizer(),
                transformer=transformer, vae=_flow_vae(1), resolution=32)


def _visualcloze_call(**extra) -> dict:
    grid = [[_pil(32, 0), _pil(32, 1)], [_pil(32, 2), None]]  # an in-context example row, then the query row
    return dict(task_prompt="Each row turns [IMAGE1] a depth map into [IMAGE2] a photo.", content_prompt="a lake",
                image=grid, generator=_generator(), num_inference_steps=2, guidance_scale=5.0,
                max_sequence_length=SEQ, **extra)


def visualcloze():
    """VisualCloze: cuts its decoded PIL grid apart with ``.crop``."""
    from diffusers import VisualClozeGenerationPipeline

    return VisualClozeGenerationPipeline(**_visualcloze_parts()), _visualcloze_call(output_type="pil")


def visualcloze_combined():
    """VisualCloze with upsampling: a generation sub-pipeline's PIL outputs feed an upsampling sub-pipeline, both
    on the pipeline's scheduler."""
    from diffusers import VisualClozePipeline

    return VisualClozePipeline(**_visualcloze_parts()), _visualcloze_call(
        output_type="pt", upsampling_height=32, upsampling_width=32, upsampling_strength=0.4)


def _sentencepiece_model() -> bytes:
    """A unigram sentencepiece model over printable ASCII (ChatGLM's tokenizer reads one from a file)."""
    import io

    import sentencepiece

    text = ["".join(chr(c) for c in range(33, 127))] + ["a tiny cat", "hello world"] * 10
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=120, model_type="unigram",
        character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, hard_vocab_limit=False, minloglevel=3)
    return model.getvalue()


def kolors(folder):
    """Kolors: its ChatGLM text encoder is a class of a diffusers pipeline module, with a config transformers'
    AutoConfig does not know. ``folder`` holds the tokenizer's sentencepiece model until the pipeline is saved."""
    from diffusers import EulerDiscreteScheduler, KolorsPipeline, UNet2DConditionModel
    from diffusers.pipelines.kolors import ChatGLMModel, ChatGLMTokenizer
    from diffusers.pipelines.kolors.text_encoder import ChatGLMConfig

    unet = _seeded(lambda: UNet2DConditionModel(
        block_out_channels=(2, 4), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=64,
        cross_attention_dim=16, norm_num_groups=1))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                       beta_schedule="scaled_linear", timestep_spacing="leading")
    model_file = folder / "tokenizer.model"
    model_file.write_bytes(_sentencepiece_model())
    tokenizer = ChatGLMTokenizer(str(model_file))
    config = ChatGLMConfig(num_layers=2, padded_vocab_size=len(tokenizer.get_vocab()) + 16, hidden_size=16,
                           ffn_hidden_size=16, kv_channels=8, num_attention_heads=2, seq_length=256,
                           multi_query_attention=True, multi_query_group_num=1, original_rope=True)
    pipe = KolorsPipeline(unet=unet, scheduler=scheduler, vae=_aekl(4, (32, 64), groups=32),
                          text_encoder=_seeded(lambda: _initialised(ChatGLMModel(config))), tokenizer=tokenizer,
                          image_encoder=None, feature_extractor=None)
    return pipe, _text_call(guidance_scale=5.0, height=32, width=32, output_type="pt")


def _initialised(model: torch.nn.Module) -> torch.nn.Module:
    """ChatGLM builds its weights with torch.empty (a checkpoint fills them): give them values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.02)
    return model


def kandinsky21():
    """Kandinsky 2.1: its M-CLIP text encoder is a class of a diffusers pipeline module, with a config transformers'
    AutoConfig does not know."""
    from diffusers import KandinskyPipeline
    from diffusers.pipelines.kandinsky.text_encoder import MCLIPConfig, MultilingualCLIP
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    specials = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                    sep_token="</s>", mask_token="<mask>")
    tokenizer = unigram_tokenizer(PreTrainedTokenizerFast, specials, 77)
    # XLM-R wraps every text in <s> ... </s>: an empty negative prompt still has tokens to average
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[(t, tokenizer.convert_tokens_to_ids(t)) for t in ("<s>", "</s>")])
    text_encoder = _seeded(lambda: MultilingualCLIP(MCLIPConfig(
        numDims=32, transformerDimensions=32, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=len(tokenizer), pad_token_id=2)))
    base, call = kandinsky22()
    unet = _seeded(lambda: _kandinsky_unet(4, "text_image", "text_image_proj"))
    pipe = KandinskyPipeline(text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=base.scheduler,
                             movq=base.movq)
    return pipe, {**call, "prompt": "a tiny cat", "height": 16, "width": 16}


def wan_animate():
    """Wan Animate: loops over segments of the pose video, encoding each through the Wan VAE's causal cache."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanAnimatePipeline, WanAnimateTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    transformer = _seeded(lambda: WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, latent_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", image_dim=4, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_encoder_size=16, motion_style_dim=8,
        motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16, face_encoder_num_heads=2,
        inject_face_latents_blocks=2))
    encoder = _seeded(lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=4,
        intermediate_size=16, patch_size=1)))
    pipe = WanAnimatePipeline(transformer=transformer, vae=_wan_vae(), text_encoder=_seeded(t5),
                              scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), tokenizer=t5_tokenizer(),
                              image_encoder=encoder, image_processor=CLIPImageProcessor(crop_size=4, size=4))
    frames = 9  # two segments of 5 frames, overlapping by one
    return pipe, _video_call(image=_pil(16), pose_video=[_pil(16, 1)] * frames, face_video=[_pil(16, 2)] * frames,
                             height=16, width=16, segment_frame_length=5, mode="animate",
                             prev_segment_conditioning_frames=1, guidance_scale=1.0)


def wan_v2v():
    """Wan video-to-video: encodes the input video through the Wan VAE's causal cache, chunk by chunk."""
    from diffusers import UniPCMultistepScheduler, WanVideoToVideoPipeline

    pipe = WanVideoToVideoPipeline(transformer=_wan_transformer(in_channels=16), vae=_wan_vae(),
                                   scheduler=UniPCMultistepScheduler(flow_shift=3.0), text_encoder=_seeded(t5),
                                   tokenizer=t5_tokenizer())
    return pipe, _video_call(video=[_pil(16, i) for i in range(9)], guidance_scale=6.0, height=16, width=16)


def hunyuan_image21():
    """HunyuanImage 2.1: its VAE's attention calls scaled dot product attention on 3-D tensors."""
    from diffusers import (
        AdaptiveProjectedMixGuidance,
        AutoencoderKLHunyuanImage,
        FlowMatchEulerDiscreteScheduler,
        HunyuanImagePipeline,
        HunyuanImageTransformer2DModel,
    )
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    transformer = _seeded(lambda: HunyuanImageTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False, text_embed_dim=32, text_embed_2_dim=32,
        rope_axes_dim=(4, 4)))
    vae = _seeded(lambda: AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 64, 64), layers_per_block=1,
        scaling_factor=0.476986, spatial_compression_ratio=8, sample_size=128))
    text_encoder, tokenizer = _qwen_vl(32, (2, 2, 4))
    byt5 = T5Config(d_model=32, d_kv=4, d_ff=16, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
                    relative_attention_max_distance=32, vocab_size=256, feed_forward_proj="gated-gelu",
                    dense_act_fn="gelu_new", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
    pipe = HunyuanImagePipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=text_encoder, text_encoder_2=_seeded(lambda: T5EncoderModel(byt5)), tokenizer=tokenizer,
        tokenizer_2=ByT5Tokenizer(), guider=AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=2),
        ocr_guider=AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=3))
    return pipe, _text_call(height=16, width=16, output_type="pt")


def _qwen_vl(hidden: int, mrope: tuple[int, int, int]):
    """A tiny Qwen2.5-VL and its tokenizer (the three vision tokens follow the text vocabulary)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    specials = dict(pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>")
    tokenizer = unigram_tokenizer(PreTrainedTokenizerFast, specials, 1024, extra=("<|im_start|>",))
    vocab = len(tokenizer) + 3
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=vocab, rope_theta=1000000.0,
                         rope_scaling={"mrope_section": list(mrope), "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=2, hidden_size=hidden, intermediate_size=hidden, num_heads=2, out_hidden_size=hidden),
        hidden_size=hidden, vocab_size=vocab, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 2,
        vision_token_id=vocab - 1)
    return _seeded(lambda: Qwen2_5_VLForConditionalGeneration(config)), tokenizer


# the families above, by name; kolors takes a scratch folder for its tokenizer file
CLASS_BUILDERS = {
    "kandinsky22_inpaint": kandinsky22_inpaint, "skyreels_df": skyreels_df, "stable_audio": stable_audio,
    "longcat_audio": longcat_audio, "anyflow_far": anyflow_far, "motif_i2v": motif_i2v, "audioldm2": audioldm2,
    "sd_sde": sd_sde, "visualcloze": visualcloze, "visualcloze_combined": visualcloze_combined, "kolors": kolors,
    "kandinsky21": kandinsky21, "wan_animate": wan_animate, "wan_v2v": wan_v2v, "hunyuan_image21": hunyuan_image21,
}


BUILDERS = {
    "sd_img2img": sd_img2img, "sd_inpaint": sd_inpaint, "sdxl_img2img": sdxl_img2img, "sdxl_inpaint": sdxl_inpaint,
    "lcm": lcm, "kandinsky22": kandinsky22, "kandinsky3": kandinsky3, "deepfloyd_if": deepfloyd_if,
    "stable_video_diffusion": stable_video_diffusion, "flux_fill": flux_fill, "flux_kontext": flux_kontext,
    "sd3": sd3, "pixart_sigma": pixart_sigma, "sana": sana, "aura_flow": aura_flow, "lumina2": lumina2,
    "hunyuan_dit": hunyuan_dit, "qwen_image": qwen_image, "hidream": hidream,
    "stable_cascade_prior": stable_cascade_prior, "stable_cascade_decoder": stable_cascade_decoder, "shap_e": shap_e,
    "wan_t2v": wan_t2v, "wan_i2v": wan_i2v, "ltx": ltx, "cogvideox": cogvideox, "latte": latte, "mochi": mochi,
}
FAMILIES = tuple(BUILDERS)


def build(name: str, scratch=None):
    """``(pipeline, call_kwargs)`` for the family ``name`` (of ``BUILDERS`` or ``CLASS_BUILDERS``); ``scratch``: a
    folder for Kolors' tokenizer file."""
    if name == "kolors":
        import tempfile
        from pathlib import Path

        pipe, kwargs = kolors(Path(scratch or tempfile.mkdtemp()))
    else:
        pipe, kwargs = {**BUILDERS, **CLASS_BUILDERS}[name]()
    pipe.set_progress_bar_config(disable=True)
    return pipe, kwargs


def true_cfg(name: str, steps: int):
    """A family's pipeline and call with true classifier-free guidance on: two denoiser calls a step."""
    pipe, call = build(name)
    if name == "qwen_image":  # a longer prompt budget: the tiny tokenizer's template alone fills 16 tokens
        call = dict(call, true_cfg_scale=4.0, max_sequence_length=200)
    return pipe, dict(call, num_inference_steps=steps)


def fresh(kwargs: dict) -> dict:
    """A copy of call kwargs with a new generator of the same seed (a run consumes its generator)."""
    return {**kwargs, "generator": _generator()}


def output(result) -> torch.Tensor:
    """The main output of a pipeline call as one tensor (images, frames, or latents)."""
    for field in ("images", "frames", "image_embeddings"):
        value = getattr(result, field, None)
        if value is not None:
            return torch.as_tensor(np.asarray(value) if isinstance(value, list) else value)
    return torch.as_tensor(result[0])


def wan22_t2v(boundary_ratio: float = 0.9):
    """Wan 2.2's two experts (as diffusers' own Wan 2.2 tests build them): ``transformer`` for the steps at or above
    ``boundary_ratio`` of the training timesteps, ``transformer_2`` (other weights) for the rest. Not in
    ``BUILDERS``: the tests of two experts build it (tests/test_experts.py)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline(transformer=_wan_transformer(in_channels=16), vae=_wan_vae(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=_seeded(t5),
                       tokenizer=t5_tokenizer(), transformer_2=_wan_transformer(1, in_channels=16),
                       boundary_ratio=boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    return pipe, {**_video_call(guidance_scale=6.0, height=16, width=16, num_frames=5), "num_inference_steps": 6}
