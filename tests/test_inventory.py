"""inspect(): sizes from safetensors headers equal the loaded modules' bytes, at every dtype; bad folders fail typed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pipemap
from helpers import plain_pipeline
from pipemap.inventory import block_tree, module_bytes, near_submodules, read_header, submodules, tensor_sizes


def _loaded_bytes(pipe) -> dict[str, int]:
    return {n: module_bytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _header_bytes(inventory) -> dict[str, int]:
    return {c.name: c.bytes for c in inventory.models}


@pytest.mark.parametrize("kind", ["sd", "sdxl", "controlnet"])
def test_fp32_header_bytes_equal_loaded_bytes(tiny_folders, kind):
    folder = tiny_folders[kind]
    assert _header_bytes(pipemap.inspect(folder)) == _loaded_bytes(plain_pipeline(folder))


def test_fp16_variant_without_dtype_loads_as_float32(tiny_folders):
    # diffusers 0.42 upcasts a variant's fp16 files to float32 unless a dtype is asked for
    folder = tiny_folders["sdxl"]
    pipe = plain_pipeline(folder, variant="fp16")
    assert _header_bytes(pipemap.inspect(folder, variant="fp16")) == _loaded_bytes(pipe)
    assert {m.dtype for m in pipe.components.values() if isinstance(m, torch.nn.Module)} == {torch.float32}


def test_fp16_variant_at_fp16_equals_loaded(tiny_folders):
    folder = tiny_folders["sdxl"]
    pipe = plain_pipeline(folder, variant="fp16", dtype=torch.float16)
    inventory = pipemap.inspect(folder, dtype=torch.float16, variant="fp16")
    assert _header_bytes(inventory) == _loaded_bytes(pipe)
    assert inventory.dtype == "float16" and inventory.variant == "fp16"


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_fp32_weights_loaded_as_fp16_equal_loaded(tiny_folders):
    folder = tiny_folders["controlnet"]
    fp32 = _header_bytes(pipemap.inspect(folder))
    fp16 = _header_bytes(pipemap.inspect(folder, torch_dtype="float16"))
    assert fp16 == _loaded_bytes(plain_pipeline(folder, dtype=torch.float16))
    assert all(fp16[name] < fp32[name] for name in fp32)


def test_weightless_components_are_listed(tiny_folders):
    inventory = pipemap.inspect(tiny_folders["sdxl"])
    weightless = {c.name for c in inventory.components if not c.has_weights}
    assert {"tokenizer", "tokenizer_2", "scheduler"} <= weightless
    assert [c.name for c in inventory.models] == ["text_encoder", "text_encoder_2", "unet", "vae"]
    assert inventory.pipeline_class == "StableDiffusionXLPipeline"


def test_loaded_pipeline_inventory_matches_folder(tiny_folders):
    folder = tiny_folders["sd"]
    from_pipe = pipemap.inspect(plain_pipeline(folder), dtype=torch.bfloat16)
    from_folder = pipemap.inspect(folder, dtype=torch.bfloat16)
    assert _header_bytes(from_pipe) == _header_bytes(from_folder)


def test_sharded_checkpoint_with_index(tmp_path, tiny_folders):
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_folders["sd"], folder)
    before = _header_bytes(pipemap.inspect(folder))
    unet = plain_pipeline(str(folder)).unet
    for f in (folder / "unet").glob("*.safetensors"):
        f.unlink()
    unet.save_pretrained(folder / "unet", max_shard_size="1MB")
    assert len(list((folder / "unet").glob("*.safetensors"))) > 1
    assert _header_bytes(pipemap.inspect(folder)) == before


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


def test_corrupt_header(tmp_path, tiny_folders):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_folders["sd"], folder)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(pipemap.CheckpointError) as err:
        pipemap.inspect(folder)
    assert err.value.path == str(weights) and "header length" in err.value.reason
    weights.write_bytes((7).to_bytes(8, "little") + b"{broken")
    with pytest.raises(pipemap.CheckpointError, match="not valid JSON"):
        pipemap.inspect(folder)
    weights.write_bytes(b"abc")
    with pytest.raises(pipemap.CheckpointError, match="shorter"):
        pipemap.inspect(folder)


def test_missing_shard_is_named(tmp_path, tiny_folders):
    folder = tmp_path / "missing-shard"
    shutil.copytree(tiny_folders["sd"], folder)
    index = {"metadata": {}, "weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors"}}
    (folder / "unet" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(pipemap.CheckpointError, match="00001-of-00002"):
        pipemap.inspect(folder)


def test_read_header_reads_header_only(tiny_folders):
    path = f"{tiny_folders['sd']}/unet/diffusion_pytorch_model.safetensors"
    with open(path, "rb") as f:
        length = 8 + int.from_bytes(f.read(8), "little")
    idle = -_bytes_read() + _bytes_read()  # what reading /proc/self/io itself costs
    before = _bytes_read()
    header = read_header(path)
    assert _bytes_read() - before - idle == length  # the length field and the JSON header, not one weight byte
    assert all({"dtype", "shape"} <= set(meta) for meta in header.values())


def _header_only(source: str, folder) -> list:
    """A copy of ``source`` whose weights files end after their headers (what a header-only fetch gives)."""
    shutil.copytree(source, folder)
    files = sorted(folder.rglob("*.safetensors"))
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data[:8 + int.from_bytes(data[:8], "little")])
    return files


@pytest.mark.slow  # a dry run: about 3 s on 2 cores
def test_plan_and_simulate_read_headers_only_load_checks_the_bytes(tmp_path, tiny_folders):
    folder = tmp_path / "headers"
    files = _header_only(tiny_folders["sd"], folder)
    whole, headers = pipemap.inspect(tiny_folders["sd"]), pipemap.inspect(folder)
    assert headers.components == whole.components  # sized, cut and mapped as the whole folder is
    # the VAE stays in its files (the disk tier): its maps are planned from the headers, and the dry run never reads
    plan = pipemap.plan(folder, hardware="1x3MiB,cpu=2MiB", strategy="balanced_ultra_low_memory", headroom=0)
    assert plan.placement("vae").disk_bytes > 0
    report = pipemap.simulate(folder, plan, advice=False)
    assert report.ok, report.error
    with pytest.raises(pipemap.CheckpointError) as err:
        pipemap.load(folder, plan=plan, progress=False)
    assert err.value.path in {str(f) for f in files} and "truncated" in err.value.reason


def _bytes_read() -> int:
    for line in open("/proc/self/io").read().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_unknown_dtype_is_typed():
    with pytest.raises(pipemap.UnknownDtypeError) as err:
        pipemap.inventory.resolve_dtype("float17", None)
    assert err.value.dtype == "float17"


def test_dtype_conflict(tiny_folders):
    with pytest.raises(pipemap.ArgumentConflictError) as err:
        pipemap.inspect(tiny_folders["sd"], dtype=torch.float16, torch_dtype=torch.bfloat16)
    assert (err.value.first, err.value.second) == ("dtype", "torch_dtype")


def test_text_encoder_follows_its_config_dtype_when_no_dtype_is_given(tmp_path):
    # a folder saved in fp16 only: its config.json says float16, and transformers loads the text encoder so
    from pipemap import tiny

    folder = tmp_path / "fp16-only"
    tiny.build("sd").to(torch.float16).save_pretrained(folder)
    pipe = plain_pipeline(str(folder))
    assert pipe.text_encoder.dtype == torch.float16 and pipe.unet.dtype == torch.float32
    assert _header_bytes(pipemap.inspect(folder)) == _loaded_bytes(pipe)


DENOISERS = ("unet", "controlnet")


def test_inventory_counts_calls_and_blocks_in_flight(tiny_folders):
    for folder in tiny_folders.values():
        headers = {c.name: c for c in pipemap.inspect(folder).models}
        live = {c.name: c for c in pipemap.inspect(plain_pipeline(folder)).models}
        for name, component in headers.items():
            assert component.calls_per_image == (100 if name in DENOISERS else 1)
            assert 0 < live[name].in_flight <= component.in_flight < component.bytes  # headers err high


def _shared_and_empty() -> torch.nn.Module:
    """A module tree torch's walk has rules for: a submodule reached twice (once deeper first) and an empty slot."""
    shared, root, inner = torch.nn.Linear(2, 2), torch.nn.Module(), torch.nn.Sequential(torch.nn.ReLU())
    inner.add_module("deep", shared)
    root.add_module("a", torch.nn.Sequential(inner, torch.nn.Tanh()))
    root.add_module("shared", shared)
    root.register_module("empty", None)
    return root


def test_submodules_walk_as_torch_does(tiny_folders):
    """The stack walk dispatch and follow use yields what ``module.modules()`` yields, in its order; the near walk
    yields each module within the depth once, as ``named_modules()`` has them."""
    pipe = plain_pipeline(tiny_folders["sdxl"])
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)] + [_shared_and_empty()]
    for module in modules:
        assert [id(m) for m in submodules(module)] == [id(m) for m in module.modules()]
    for module in modules[:-1]:  # no module shared: every module within the depth is there, at its own path
        named = [m for name, m in module.named_modules() if name and name.count(".") < 2]
        near = [id(m) for m in near_submodules(module, 2)]
        assert len(near) == len(set(near)) and set(near) == {id(m) for m in named}
    near = near_submodules(modules[-1], 2)
    assert len(near) == len({id(m) for m in near}) == 4  # a, a.0, a.1, shared: once, though also 3 levels down


def test_block_tree_from_headers_is_the_module_tree(tiny_folders):
    """A tree from tensor names has a block per module holding tensors (or holding one that does), each with its
    subtree's bytes, children in natural order (``blocks.10`` after ``blocks.9``)."""
    pipe = plain_pipeline(tiny_folders["sd"])
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        sizes = tensor_sizes(module)
        tree, paths = block_tree(sizes), []
        stack = [tree]
        while stack:
            block = stack.pop()
            paths.append(block.path)
            assert block.bytes == block.own + sum(c.bytes for c in block.children)
            names = [c.path.rpartition(".")[2] for c in block.children]
            assert names == sorted(names, key=lambda p: (not p.isdigit(), int(p) if p.isdigit() else 0, p))
            stack.extend(block.children)
        holding = {""} | {key.rpartition(".")[0] for key in sizes}  # the modules holding a saved tensor
        for path in list(holding):
            while path:
                path = path.rpartition(".")[0]
                holding.add(path)  # and every module above one
        assert sorted(paths) == sorted(holding), name
        assert holding <= {n for n, _ in module.named_modules()}
        assert tree.bytes >= sum(sizes.values())  # each tensor aligned as in a streaming buffer
