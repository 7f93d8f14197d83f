"""Host buffers (``hooks/packing.py``): a group's tensors packed into one exact-size buffer, the same layout on the
host and on every device, pinned as one page-locked range (the CUDA calls replaced by recorders here)."""

from __future__ import annotations

import torch

from pipemap.hooks import packing
from pipemap.units import aligned


def test_pinned_buffer_is_exactly_the_group_layout(monkeypatch):
    registered = []
    monkeypatch.setattr(packing, "_pin_host", lambda buffer: registered.append(buffer.numel()))
    monkeypatch.setattr(packing, "_unpin_host", lambda buffer: registered.append(-buffer.numel()))
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2, bias=False))
    model.register_buffer("steps", torch.arange(3))
    values = {n: t.detach().clone() for n, t in model.state_dict().items()}
    group = packing.Group(packing.slots(model.modules()).values())
    sizes = [t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]]
    # 60 + 20 + 20 + 20 + 40 + 24 bytes; in the layout each start is aligned to 16: 64 + 32 + 32 + 32 + 48 + 24
    assert group.nbytes == sum(sizes) == 184
    assert group.layout.nbytes == sum(aligned(s) for s in sizes[:-1]) + sizes[-1] == 232
    group.pin()
    assert registered == [group.layout.nbytes] and packing.pinned_bytes() == 232
    host = group.host.data_ptr()
    assert all(host <= s.get().data_ptr() < host + 200 for s in group.slots)  # every master a view of it
    assert all(torch.equal(model.state_dict()[n], v) for n, v in values.items())
    model.half()  # a dtype change: the float masters are new tensors, pinned again at the next onload
    group.repin()
    assert registered == [232, -232, group.layout.nbytes] and group.layout.nbytes < 232 and group.pinned()
    current = group.host  # held here, so the allocator cannot hand its addresses to the new masters
    start, end = current.data_ptr(), current.data_ptr() + current.numel() * current.element_size()
    group.unpin()
    assert registered[-1] == -group.layout.nbytes and packing.pinned_bytes() == 0
    assert all(not (start <= s.get().data_ptr() < end) for s in group.slots)  # masters of their own again


# ---- layouts and groups, pinned or not ----------------------------------------------------------------------------


def test_packing_aligns_each_start_and_ends_at_the_last_byte():
    layout = packing.Packing.of([torch.zeros(3), torch.zeros(2, dtype=torch.float16), torch.zeros(1, 5)])
    assert layout.entries == ((0, torch.float32, (3,)), (16, torch.float16, (2,)), (32, torch.float32, (1, 5)))
    assert layout.nbytes == 52 and layout.nbytes % 16 != 0  # no padding after the last tensor
    assert layout.fits([torch.ones(3), torch.ones(2, dtype=torch.float16), torch.ones(1, 5)])
    assert not layout.fits([torch.ones(3), torch.ones(2), torch.ones(1, 5)])  # another dtype: another layout


def test_views_are_the_tensors_in_place_in_the_buffer():
    tensors = [torch.arange(3.0), torch.tensor([7, 8], dtype=torch.float16), torch.arange(6.0).reshape(2, 3)]
    layout = packing.Packing.of(tensors)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    for view, tensor in zip(views, tensors, strict=True):
        view.copy_(tensor)
    assert all(torch.equal(v, t) and v.dtype == t.dtype for v, t in zip(views, tensors))
    start = buffer.data_ptr()
    assert [v.data_ptr() - start for v in views] == [offset for offset, _, _ in layout.entries]


def test_slots_finds_a_shared_tensor_once_with_every_owner():
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    second.weight = first.weight  # tied, as a text encoder's embeddings and head may be
    model = torch.nn.Sequential(first, second)
    found = packing.slots(model.modules())
    assert len(found) == 3  # one weight, two biases
    shared = found[id(first.weight)]
    assert shared.store == "_parameters" and [key for _, key in shared.owners] == ["weight", "weight"]


def test_install_points_every_tensor_at_the_buffer_and_evict_gives_back_the_very_masters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    masters = [*model.parameters(), *model.buffers()]
    group = packing.Group(packing.slots(model.modules()).values(), "m")
    buffer = torch.empty(group.layout.nbytes, dtype=torch.uint8)
    for place, master in group.install(buffer):
        place.copy_(master)
    assert group.loaded
    onloaded = [*model.parameters(), *model.buffers()]
    start = buffer.data_ptr()
    assert all(start <= t.data_ptr() < start + buffer.numel() for t in onloaded if t.numel())
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(onloaded, masters))
    assert group.evict() == 0  # nothing converted meanwhile: nothing copied back
    assert all(a is b for a, b in zip([*model.parameters(), *model.buffers()], masters)) and not group.loaded


def test_a_dtype_change_while_onloaded_is_kept_at_eviction():
    model = torch.nn.Linear(2, 2)
    group = packing.Group(packing.slots(model.modules()).values())
    for place, master in group.install(torch.empty(group.layout.nbytes, dtype=torch.uint8)):
        place.copy_(master)
    model.half()  # what a pipeline may do to its vae (upcast or downcast) while it runs
    assert group.evict() == (4 + 2) * 2  # the weight (4 values) and bias (2) copied back, 2 bytes each
    assert model.weight.dtype == torch.float16 and model.weight.device.type == "cpu"
    assert group.layout.entries[0][1] == torch.float16  # the layout follows the tensors as they are now
