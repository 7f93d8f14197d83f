"""pipemap.inventory (the package): ``inventory_of`` chooses between a folder and a loaded pipeline, and both give
the same sizes: a folder's headers equal the loaded modules' bytes, at every dtype. The package's modules import
one another downwards, never the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pipemap
from helpers import plain_pipeline
from pipemap.inventory.live import module_bytes


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


def test_loaded_pipeline_inventory_matches_folder(tiny_folders):
    folder = tiny_folders["sd"]
    from_pipe = pipemap.inspect(plain_pipeline(folder), dtype=torch.bfloat16)
    from_folder = pipemap.inspect(folder, dtype=torch.bfloat16)
    assert _header_bytes(from_pipe) == _header_bytes(from_folder)


def test_dtype_conflict(tiny_folders):
    with pytest.raises(pipemap.ArgumentConflictError) as err:
        pipemap.inspect(tiny_folders["sd"], dtype=torch.float16, torch_dtype=torch.bfloat16)
    assert (err.value.first, err.value.second) == ("dtype", "torch_dtype")


DENOISERS = ("unet", "controlnet")


def test_inventory_counts_calls_and_blocks_in_flight(tiny_folders):
    for folder in tiny_folders.values():
        headers = {c.name: c for c in pipemap.inspect(folder).models}
        live = {c.name: c for c in pipemap.inspect(plain_pipeline(folder)).models}
        for name, component in headers.items():
            assert component.calls_per_image == (100 if name in DENOISERS else 1)
            assert 0 < live[name].in_flight <= component.in_flight < component.bytes  # headers err high


def test_inventory_of_an_inventory_is_itself_and_of_anything_else_is_typed(sd_inventory):
    assert pipemap.inventory.inventory_of(sd_inventory) is sd_inventory
    with pytest.raises(pipemap.NotAPipelineError) as err:
        pipemap.inspect(42)
    assert err.value.path == "42" and "a folder path, an Inventory or a loaded DiffusionPipeline" in err.value.reason
    with pytest.raises(pipemap.ArgumentTypeError) as err:
        pipemap.inspect(sd_inventory, variant=16)
    assert err.value.argument == "variant" and err.value.value == 16


PACKAGE = Path(pipemap.inventory.__file__).parent
# each module of the wing and the ones it may import: downwards only, never the package (``__init__``: a circle)
BELOW = {"values": set(), "trees": set(), "files": {"values"}, "folder": {"values", "trees", "files"},
         "live": {"values", "trees", "folder"}}


def _imported(path: Path) -> set[str]:
    """The modules of the wing a module imports (``""``: the package itself)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add(node.module or "")
    return found


def test_the_wing_imports_downwards_and_each_module_stays_small():
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert set(modules) == set(BELOW)
    assert {name: _imported(path) - BELOW[name] for name, path in modules.items()} == dict.fromkeys(BELOW, set())
    assert {name: n for name, path in modules.items() if (n := len(path.read_text().splitlines())) >= 450} == {}
