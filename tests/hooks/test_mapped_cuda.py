"""The disk tier (``hooks/mapped.py``) with CUDA on, under the fake CUDA (tests/fakecuda.py), race check on: an
onload through the staging ring is ordered after the compute stream's earlier use of its buffer's memory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import fakecuda
import families
from pipemap.hooks import Ledger, hook_component, unhook_component
from pipemap.hooks.offload import OffloadHook
from pipemap.hooks.stream import StreamHook
from pipemap.inventory import stream_blocks
from pipemap.plan import Placement


def _mapped_net(folder) -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    path = folder / "net.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, path)
    net.load_state_dict(load_file(path), assign=True)  # every weight a view of the file's map, as diffusers loads
    return net


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _activation_freed(nbytes: int) -> None:
    """The previous component's last activation: written on the compute stream and freed at once (its kernel may
    still be queued on a GPU), so its memory is the next allocation's on that stream."""
    activation = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    activation.fill_(7)
    del activation


@pytest.mark.parametrize("from_disk", [True, False])
def test_an_offloaded_onload_from_the_files_waits_for_the_compute_stream(fake_cuda, tmp_path, from_disk):
    fake_cuda.trace = True
    net = _mapped_net(tmp_path)
    expected = net(torch.ones(4, 64))
    size = _bytes(net)
    placement = Placement("net", "cpu", size, "offload", "cuda:0", room=0, disk_bytes=size if from_disk else 0)
    hook = OffloadHook.for_placement(placement, "cuda:0", Ledger())
    hook_component(net, hook)
    assert (id(hook.group) in hook.from_files) == from_disk
    x = torch.ones(4, 64, device="cuda:0")
    for _ in range(2):  # room 0: evicted after each call, onloaded again into the freed activation's memory
        _activation_freed(hook.group.layout.nbytes)
        torch.testing.assert_close(fakecuda.host(net(x)), expected)
    unhook_component(net)  # the fixture fails the test on any race left


def test_a_streamed_root_from_the_files_waits_for_the_compute_stream(fake_cuda, tmp_path):
    from transformers import T5EncoderModel

    fake_cuda.trace = True
    families.t5().save_pretrained(tmp_path / "t5")
    net = T5EncoderModel.from_pretrained(tmp_path / "t5")  # weights: views of the file's map
    ids = torch.ones(1, 8, dtype=torch.long)
    expected = net(ids).last_hidden_state
    blocks = tuple((path, _bytes(block)) for path, block in stream_blocks(net))
    placement = Placement("text_encoder_2", "cpu", _bytes(net), "stream", "cuda:0", room=max(b for _, b in blocks) * 2,
                          blocks=blocks, prefetch=1, disk_blocks=tuple(path for path, _ in blocks),
                          disk_bytes=_bytes(net), files=(str(tmp_path / "t5" / "model.safetensors"),))
    hook = StreamHook.for_placement(placement, "cuda:0", Ledger())
    hook_component(net, hook)
    assert id(hook.root) in hook.from_files  # T5's tied embedding: the root group travels with the disk tier
    for _ in range(2):
        _activation_freed(hook.root.layout.nbytes)
        out = net(ids.to("cuda:0")).last_hidden_state
        torch.testing.assert_close(fakecuda.host(out), expected)
    unhook_component(net)


def test_the_staging_ring_is_given_back_when_its_last_reader_detaches(fake_cuda, tmp_path):
    nets = [_mapped_net(tmp_path / name) for name in ("a", "b") if not (tmp_path / name).mkdir()]
    ledger = Ledger()
    for i, net in enumerate(nets):
        size = _bytes(net)
        hook_component(net, OffloadHook.for_placement(
            Placement(f"net{i}", "cpu", size, "offload", "cuda:0", room=0, disk_bytes=size), "cuda:0", ledger))
    x = torch.ones(4, 64, device="cuda:0")
    for net in nets:
        net(x)
    staging = ledger.staging(torch.device("cuda:0"))
    assert len(staging.slots) == 2 and len(fake_cuda.registered) == 2  # page-locked, exactly their bytes
    assert sum(fake_cuda.registered.values()) == 2 * staging.size
    unhook_component(nets[0])
    assert len(fake_cuda.registered) == 2  # the other still reads through it
    unhook_component(nets[1])  # what pipemap.reset does: nothing page-locked is left, in no allocator's cache
    assert fake_cuda.registered == {} and fake_cuda.host_pinned == {} and fake_cuda.host_cached == {}
    assert staging.slots == []
