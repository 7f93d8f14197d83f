"""quantized.py: quantized weights' storage, their stored size, rebuilt around other storage; quantized checkpoints
sized from their headers (quanto, bitsandbytes layouts) and GGUF tensor tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import pipemap
from everyday import quantize
from pipemap.inventory.folder import of_folder
from pipemap.quantized import gguf_sizes, is_packed, quantization_state, rebuild_from, storage, stored_bytes


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).eval()


@pytest.mark.parametrize("library", ["quanto", "torchao"])
def test_a_quantized_weight_is_its_int8_storage_and_rebuilds_around_a_copy(library):
    model = quantize(_mlp(), library)
    weight = model[0].weight
    assert is_packed(weight) and not is_packed(model[0].bias) and not is_packed(torch.zeros(2))
    leaves = storage(weight)
    assert torch.int8 in {t.dtype for t in leaves} and all(not is_packed(t) for t in leaves)
    assert stored_bytes(weight) == sum(t.numel() * t.element_size() for t in leaves) < 64 * 64 * 2  # not float
    x = torch.randn(3, 64)
    want = model(x)
    copies = [t.clone() for t in leaves]
    model[0].weight = torch.nn.Parameter(rebuild_from(weight)(copies), requires_grad=False)
    assert type(model[0].weight) is type(weight)
    assert [t.data_ptr() for t in storage(model[0].weight)] == [t.data_ptr() for t in copies]
    torch.testing.assert_close(model(x), want, atol=0, rtol=0)


def _quantized_folder(tmp_path, config: dict, tensors: dict[str, torch.Tensor]):
    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    (tmp_path / "unet" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "unet" / "diffusion_pytorch_model.safetensors"))
    return tmp_path


def test_a_quanto_checkpoint_keeps_its_int8_data_and_float_scales_at_any_dtype(tmp_path):
    tensors = {"a.weight._data": torch.zeros(64, 64, dtype=torch.int8), "a.weight._scale": torch.ones(64, 1),
               "a.bias": torch.zeros(64), "a.input_scale": torch.ones(()), "a.output_scale": torch.ones(())}
    folder = _quantized_folder(tmp_path, {"quantization_config": {"quant_method": "quanto", "weights": "int8"}},
                               tensors)
    unet = of_folder(folder, torch.float16, None)["unet"]
    # 4096 int8 + 64 float32 scales + 2 float32 activation scales stay; the bias converts to float16
    assert unet.bytes == 4096 + 64 * 4 + 2 * 4 + 64 * 2


def test_a_bitsandbytes_checkpoint_keeps_its_quantization_state(tmp_path):
    tensors = {"a.weight": torch.zeros(2048, 1, dtype=torch.uint8), "a.weight.absmax": torch.ones(64),
               "a.weight.quant_map": torch.ones(16), "a.weight.quant_state.bitsandbytes__nf4": torch.zeros(
                   100, dtype=torch.uint8), "a.bias": torch.zeros(64)}
    folder = _quantized_folder(tmp_path, {"quantization_config": {"quant_method": "bitsandbytes"}}, tensors)
    assert of_folder(folder, torch.bfloat16, None)["unet"].bytes == 2048 + 64 * 4 + 16 * 4 + 100 + 64 * 2
    assert quantization_state("a.weight.absmax", True) and not quantization_state("a.weight.absmax", False)
    assert not quantization_state("a.weight", True)


def test_gguf_sizes_come_from_the_tensor_table(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "flux")
    # a Q8_0 tensor: blocks of 32 elements, 34 bytes each (32 int8 and a float16 scale); an F16 one
    blocks = np.zeros((64, 64 // 32 * 34), dtype=np.uint8)
    writer.add_tensor("a.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("a.bias", np.zeros(64, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_sizes(path) == {"a.weight": 64 * 64 // 32 * 34, "a.bias": 64 * 2}


def test_a_live_quantized_module_is_inspected_at_its_storage():
    model = quantize(_mlp(), "quanto")
    from pipemap.inventory import live_component

    component = live_component("unet", model)
    assert component.bytes == sum(stored_bytes(t) for t in model.state_dict(keep_vars=True).values()
                                  if isinstance(t, torch.Tensor))
    assert isinstance(pipemap.format_bytes(component.bytes), str)
