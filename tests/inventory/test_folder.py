"""inventory/folder.py: facts about a checkpoint folder: ``model_index.json`` checked, weightless entries listed,
the dtype each entry loads in as its library decides, and how the dry run's stand-in builder is to build each
model entry (``model_entry``)."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import plain_pipeline
from pipemap.inventory.folder import model_entry
from pipemap.inventory.live import module_bytes


def _loaded_bytes(pipe) -> dict[str, int]:
    return {n: module_bytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _header_bytes(inventory) -> dict[str, int]:
    return {c.name: c.bytes for c in inventory.models}


def test_weightless_components_are_listed(tiny_folders):
    inventory = pipemap.inspect(tiny_folders["sdxl"])
    weightless = {c.name for c in inventory.components if not c.has_weights}
    assert {"tokenizer", "tokenizer_2", "scheduler"} <= weightless
    assert [c.name for c in inventory.models] == ["text_encoder", "text_encoder_2", "unet", "vae"]
    assert inventory.pipeline_class == "StableDiffusionXLPipeline"


def test_not_a_pipeline_folder(tmp_path):
    with pytest.raises(pipemap.NotAPipelineError) as err:
        pipemap.inspect(tmp_path)
    assert err.value.path == str(tmp_path) and "model_index.json" in err.value.reason
    assert isinstance(err.value, ValueError)
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(pipemap.NotAPipelineError, match="not valid JSON"):
        pipemap.inspect(tmp_path)
    with pytest.raises(pipemap.NotAPipelineError, match="no such folder"):
        pipemap.inspect(tmp_path / "missing")


def test_text_encoder_follows_its_config_dtype_when_no_dtype_is_given(tmp_path):
    # a folder saved in fp16 only: its config.json says float16, and transformers loads the text encoder so
    from pipemap import tiny

    folder = tmp_path / "fp16-only"
    tiny.build("sd").to(torch.float16).save_pretrained(folder)
    pipe = plain_pipeline(str(folder))
    assert pipe.text_encoder.dtype == torch.float16 and pipe.unet.dtype == torch.float32
    assert _header_bytes(pipemap.inspect(folder)) == _loaded_bytes(pipe)


def test_model_entry_is_how_from_pretrained_builds_the_entry(tiny_folders):
    from pathlib import Path

    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    folder = Path(tiny_folders["sd"])
    pipe = plain_pipeline(str(folder), dtype=torch.float16)
    unet = model_entry(folder, "unet", "diffusers", "UNet2DConditionModel", torch.float16)
    encoder = model_entry(folder, "text_encoder", "transformers", "CLIPTextModel", None)
    assert unet is not None and encoder is not None
    assert (unet.cls, unet.library, unet.dtype) == (UNet2DConditionModel, "diffusers", pipe.unet.dtype)
    # no dtype asked: transformers loads the text encoder in its config's dtype (float32 here)
    assert (encoder.cls, encoder.library, encoder.dtype) == (CLIPTextModel, "transformers", torch.float32)
    assert model_entry(folder, "tokenizer", "transformers", "CLIPTokenizer", None) is None  # no weights
    assert model_entry(folder, "scheduler", "diffusers", "PNDMScheduler", None) is None
    assert model_entry(folder, "unet", "diffusers", "NoSuchModel", None) is None
