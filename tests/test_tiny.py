"""The tiny pipelines built in code (``pipemap.tiny``): each kind builds, saves and loads back through diffusers,
deterministically, with nothing downloaded; ``default_call`` is a fast call each kind takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

from helpers import plain_pipeline
from pipemap import tiny

CLASSES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
           "controlnet": "StableDiffusionControlNetPipeline", "flux": "FluxPipeline"}


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)
            for key, value in module.state_dict().items()}


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_each_kind_saved_loads_back_through_diffusers_with_the_weights_it_was_built_with(tiny_folders, kind):
    folder = Path(tiny_folders[kind])
    loaded = DiffusionPipeline.from_pretrained(folder)
    built = tiny.build(kind)
    assert type(loaded).__name__ == type(built).__name__ == CLASSES[kind]
    want, got = _weights(built), _weights(loaded)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(t.dtype == torch.float32 for t in got.values())  # config.json says float32: saved last
    # each model also saved in an fp16 variant, beside its fp32 weights
    models = [name for name, m in built.components.items() if isinstance(m, torch.nn.Module)]
    assert all(list((folder / name).glob("*.fp16.safetensors")) for name in models)
    half = DiffusionPipeline.from_pretrained(folder, variant="fp16", torch_dtype=torch.float16)
    assert half.unet.dtype == torch.float16


def test_building_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first, second = _weights(tiny.build("sdxl")), _weights(tiny.build("sdxl"))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(first[k], second[k]) for k in first)
    # the two text encoders, of one width, seeded apart
    assert not torch.equal(first["text_encoder.embeddings.token_embedding.weight"],
                           first["text_encoder_2.text_model.embeddings.token_embedding.weight"])


def test_scale_widens_every_channel():
    small, wide = tiny.build("sd"), tiny.build("sd", scale=2)
    assert wide.unet.config.block_out_channels == tuple(2 * c for c in small.unet.config.block_out_channels)
    assert wide.text_encoder.config.hidden_size == 2 * small.text_encoder.config.hidden_size


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown tiny pipeline kind 'sd2'"):
        tiny.build("sd2")


def test_the_tokenizer_is_byte_level_with_no_merges():
    vocab = tiny.tokenizer_vocab()
    assert len(vocab) == tiny.VOCAB_SIZE == 514 and vocab[tiny.BOS] == 512 and vocab[tiny.EOS] == 513
    tokenizer = tiny.build_tokenizer()
    # a, t, i, n, y, c, a, t: one token a byte; the last of each word with </w> (byte + 256)
    assert tokenizer("a tiny cat").input_ids == [512, 97 + 256, 116, 105, 110, 121 + 256, 99, 97, 116 + 256, 513]
    assert tokenizer.model_max_length == 77 and tokenizer.pad_token == tiny.EOS


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_default_call_runs_two_steps_to_a_32_pixel_image(tiny_folders, reference_outputs, kind):
    call = tiny.default_call(plain_pipeline(tiny_folders[kind]), kind)
    assert call["num_inference_steps"] == 2 and call["output_type"] == "np" and call["prompt"] == "a tiny cat"
    assert ("image" in call) == (kind == "controlnet")
    if kind == "controlnet":
        assert call["image"].size == (32, 32)
    assert reference_outputs[kind].shape == (1, 32, 32, 3)  # what the default call made


def test_default_call_of_the_flux_like_pipeline():
    pipe = tiny.build("flux")
    assert type(pipe).__name__ == CLASSES["flux"]
    call = tiny.default_call(pipe, "flux", output_type="pt")
    assert (call["height"], call["width"], call["max_sequence_length"]) == (32, 32, tiny.FLUX_TOKENS)
    assert call["output_type"] == "pt" and "negative_prompt" not in call
    assert torch.equal(call["generator"].get_state(), torch.Generator().manual_seed(0).get_state())


def test_control_image_is_deterministic():
    pipe = tiny.build("controlnet")
    assert tiny.resolution(pipe) == 32
    assert tiny.control_image(pipe).tobytes() == tiny.control_image(pipe).tobytes()
    assert tiny.control_image(pipe).tobytes() != tiny.control_image(pipe, seed=1).tobytes()
