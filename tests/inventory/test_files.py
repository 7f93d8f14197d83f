"""inventory/files.py: a component's safetensors files (shards, variants) and their headers, read without a weight
byte; a file shorter than its header says fails typed when loading asks."""

from __future__ import annotations

import json
import shutil

import pytest

import pipemap
from helpers import plain_pipeline
from pipemap.inventory.files import check_weights_present, read_header, variant_of


def _header_bytes(inventory) -> dict[str, int]:
    return {c.name: c.bytes for c in inventory.models}


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


def test_the_weights_check_reads_no_header_the_inventory_already_read(tmp_path, tiny_folders):
    folder = tmp_path / "sized"
    shutil.copytree(tiny_folders["sd"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    sized = pipemap.inspect(folder)
    files = sorted(f for f in folder.rglob("*.safetensors") if variant_of(f) is None)  # not the fp16 variant's
    assert {f for c in sized.models for f, _ in c.ends} == {str(f.relative_to(folder)) for f in files}
    idle = -_bytes_read() + _bytes_read()
    before = _bytes_read()
    check_weights_present(folder, index, None, sized=sized)
    assert _bytes_read() - before - idle == 0  # sizes from stat, ends from the inventory: not one byte read
    before = _bytes_read()
    check_weights_present(folder, index, None)  # without it, every header is read again
    assert _bytes_read() - before - idle >= sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:-1])  # cut after sizing: the carried end still catches it
    with pytest.raises(pipemap.CheckpointError) as err:
        check_weights_present(folder, index, None, sized=sized)
    assert err.value.path == str(vae) and "truncated" in err.value.reason
