"""``hooks/mapped.py``: weights left in their safetensors files' maps, read through the staging ring at each call and
their pages handed back; a pipeline whose plan has a disk tier runs as plain diffusers does."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import pipemap
from helpers import plain_pipeline
from pipemap import tiny
from pipemap.hooks import Ledger, hook_component, unhook_component
from pipemap.hooks.mapped import Pages, Staging, _pages
from pipemap.hooks.offload import OffloadHook
from pipemap.hooks.packing import Group, slots
from pipemap.plan import Placement
from pipemap.ram import file_maps
from pipemap.runtime.streams import ModelQueues


def _rss_file() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


@pytest.fixture
def mapped(tmp_path) -> dict[str, torch.Tensor]:
    path = tmp_path / "weights.safetensors"
    save_file({"big": torch.randn(4096, 2048), "small": torch.arange(1000, dtype=torch.float16).reshape(10, 100),
               "flag": torch.tensor([True, False, True])}, path)
    return load_file(path)  # views of the file's map, as diffusers' loading leaves weights stored at the dtype asked


def test_pages_read_are_handed_back(mapped):
    pages = Pages(mapped.values())
    assert pages.nbytes >= 4096 * 2048 * 4 - 2 * 4096  # whole pages inside the tensors, edges left
    float(mapped["big"].sum())  # read: 32 MiB of the file counted in this process
    touched = _rss_file()
    pages.release()
    assert touched - _rss_file() >= 24 * 2**20
    assert float(mapped["big"].sum()) == float(mapped["big"].clone().sum())  # read again from the file, unchanged


def test_private_memory_is_never_handed_back():
    tensor = torch.randn(1024, 1024)
    pages = Pages([tensor, tensor.to("meta")])
    assert pages.ranges == [] and pages.nbytes == 0
    pages.release()
    assert torch.isfinite(tensor).all()


def test_merged_spans_cut_to_whole_pages():
    page = 4096
    assert _pages([(10, page * 2 + 10), (page * 2 + 20, page * 5)]) == [(page, page * 4)]
    assert _pages([(1, 100)]) == []


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_staging_copies_every_byte_in_chunks(mapped):
    module = torch.nn.Module()
    for name, tensor in mapped.items():
        module.register_buffer(name, tensor)
    group = Group(slots([module]).values(), "test")
    queues = ModelQueues(torch.device("cpu"))
    staging = Staging(queues)
    staging.need(1000)  # slots of 1000 bytes: the 32 MiB tensor crosses many chunk boundaries
    buffer = torch.empty(group.layout.nbytes, dtype=torch.uint8)
    copies = group.install(buffer)
    event = staging.copy(buffer, group.layout, [master for _, master in copies], name="test")
    queues.wait(event)
    for name, value in module.named_buffers():
        assert torch.equal(value, mapped[name]) and value.data_ptr() != mapped[name].data_ptr()
    assert [s.numel() for s in staging.slots] == [1000, 1000]
    group.evict()
    assert module.big is mapped["big"]


# ---- the weights written in place, the file changed under the map ---------------------------------------------


def _offloaded_from_disk(folder, width: int = 256) -> torch.nn.Module:
    """A module whose weights are views of a safetensors file's map, offloaded with its plan's disk tier on, room 0
    (read from the file at each call)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
    path = folder / "net.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, path)
    net.load_state_dict(load_file(path), assign=True)
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    placement = Placement("net", "cpu", size, "offload", "cpu", room=0, disk_bytes=size)
    hook_component(net, OffloadHook.for_placement(placement, "cpu", Ledger()))
    assert id(net._hf_hook.group) in net._hf_hook.from_files
    return net


def test_an_in_place_change_to_disk_tier_weights_survives_its_onloads(tmp_path):
    net = _offloaded_from_disk(tmp_path)
    x = torch.randn(2, 256)
    with torch.no_grad():
        before = net(x)
        for p in net.parameters():  # what fuse_lora and load_state_dict do: write into the masters in place
            p.mul_(2.0)
        calls = [net(x) for _ in range(3)]
    assert not torch.equal(calls[0], before)
    for later in calls[1:]:  # each a new read from the map: the written pages were kept
        torch.testing.assert_close(later, calls[0], atol=0, rtol=0)
    unhook_component(net)
    with torch.no_grad():
        torch.testing.assert_close(net(x), calls[0], atol=0, rtol=0)  # the module itself keeps the change


def test_written_pages_are_not_handed_back(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(64 * 1024)}, path)  # 64 pages of 4 KiB
    w = load_file(path)["w"]
    clean = Pages([w])
    w[8 * 1024] = 1.0  # one page written: private now
    written = Pages([w])
    assert written.nbytes == clean.nbytes - mmap.PAGESIZE
    written.release()
    assert float(w[8 * 1024]) == 1.0


def test_a_weights_file_rewritten_in_place_raises_a_typed_error(tmp_path):
    net = _offloaded_from_disk(tmp_path)
    x = torch.randn(2, 256)
    path = tmp_path / "net.safetensors"
    with torch.no_grad():
        net(x)
        with open(path, "r+b") as f:  # same size, another value at the end: a script saving over the folder
            f.seek(-4, 2)
            f.write(bytes(4))
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        with pytest.raises(pipemap.WeightsFileChangedError) as caught:
            net(x)
    assert caught.value.path == str(path) and caught.value.component == "net"
    unhook_component(net)


def test_a_weights_file_replaced_by_a_new_one_leaves_the_mapped_one_in_use(tmp_path):
    net = _offloaded_from_disk(tmp_path)
    x = torch.randn(2, 256)
    with torch.no_grad():
        before = net(x)
        save_file({"other": torch.zeros(16)}, tmp_path / "new.safetensors")
        os.replace(tmp_path / "new.safetensors", tmp_path / "net.safetensors")  # save_pretrained, downloads
        torch.testing.assert_close(net(x), before, atol=0, rtol=0)
    unhook_component(net)


_TRUNCATED = """
import shutil, sys, pathlib, torch
from safetensors.torch import load_file, save_file
import pipemap
from pipemap.hooks import Ledger, hook_component
from pipemap.hooks.offload import OffloadHook
folder = pathlib.Path(sys.argv[1])
net = torch.nn.Linear(256, 256)
save_file(dict(net.state_dict()), folder / "net.safetensors")
net.load_state_dict(load_file(folder / "net.safetensors"), assign=True)
size = 257 * 256 * 4
hook_component(net, OffloadHook.for_placement(
    pipemap.Placement("net", "cpu", size, "offload", "cpu", room=0, disk_bytes=size), "cpu", Ledger()))
with torch.no_grad():
    net(torch.ones(2, 256))
    save_file({"other": torch.zeros(16)}, folder / "other.safetensors")
    shutil.copyfile(folder / "other.safetensors", folder / "net.safetensors")  # truncated in place, rewritten
    try:
        net(torch.ones(2, 256))
    except pipemap.WeightsFileChangedError as error:
        print("typed:", error.reason)
"""


@pytest.mark.slow
def test_a_weights_file_truncated_in_place_raises_a_typed_error_not_sigbus(tmp_path):
    child = subprocess.run([sys.executable, "-c", _TRUNCATED, str(tmp_path)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": "src"})
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])  # -7: SIGBUS
    assert "typed:" in child.stdout and "bytes became 136" in child.stdout


# ---- a pipeline with a disk tier --------------------------------------------------------------------------------


@pytest.mark.slow
def test_disk_tier_runs_as_plain_diffusers(tiny_folders, reference_outputs):
    # one small GPU and RAM for a quarter of the weights: the text encoders from their files, the unet partly resident
    folder = tiny_folders["sd"]
    total = sum(c.bytes for c in pipemap.inspect(folder).models)
    plan = pipemap.plan(folder, hardware=f"cuda:0={total // 3},cpu={total // 4}", strategy="balanced_ultra_low_memory")
    assert plan.host.disk and plan.host.kept
    pipe = pipemap.load(folder, plan=plan.remap({"cuda:0": "cpu"}), progress=False)
    output = torch.as_tensor(pipe(**tiny.default_call(pipe, "sd")).images)
    torch.testing.assert_close(output, reference_outputs["sd"], rtol=0, atol=0)
    stats = pipemap.stats(pipe)
    assert stats["text_encoder"]["h2d_bytes"] > 0
    # a reset gives back the pipeline as diffusers loaded it: every weight a view of its file again
    pipemap.reset(pipe)
    maps = file_maps()
    for name in ("text_encoder", "unet"):
        weights = list(getattr(pipe, name).parameters())
        assert all(maps.file_of(w.data_ptr(), w.numel() * w.element_size()) for w in weights), name
    output = torch.as_tensor(pipe(**tiny.default_call(pipe, "sd")).images)
    torch.testing.assert_close(output, reference_outputs["sd"], rtol=0, atol=0)


@pytest.mark.slow
def test_a_diffusers_loaded_pipeline_keeps_its_maps(tiny_folders, reference_outputs):
    # dispatch of a pipeline diffusers loaded: its weights are the files' maps, so its plan may leave them there
    pipe = plain_pipeline(tiny_folders["sd"])
    inventory = pipemap.inspect(pipe)
    assert all(c.files for c in inventory.models)
    total = sum(c.bytes for c in inventory.models)
    plan = pipemap.plan(pipe, hardware=f"cuda:0={total * 3 // 5},cpu={2 * total}", strategy="balanced_low_memory")
    assert plan.host.disk
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu"}))
    output = torch.as_tensor(pipe(**tiny.default_call(pipe, "sd")).images)
    torch.testing.assert_close(output, reference_outputs["sd"], rtol=0, atol=0)
