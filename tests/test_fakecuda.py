"""The fake CUDA of the test suite (tests/fakecuda.py): PyTorch's stream, event, allocator and copy semantics, and a
checker that finds what a missing wait would let a GPU reorder. Every test of pipemap's CUDA code relies on it."""

from __future__ import annotations

import threading

import pytest
import torch

import fakecuda

MIB = 2**20


def _ops(fake) -> list[str]:
    return [f"{r.earlier.kind} {r.earlier.op} || {r.later.kind} {r.later.op}" for r in fake.take()]


def test_values_are_computed_for_real_and_devices_are_cuda(fake_cuda):
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    expected = layer(x)
    layer.to("cuda:1")
    out = layer(x.to("cuda:1"))
    assert out.device == torch.device("cuda:1") and fakecuda.on_device(out)
    torch.testing.assert_close(out.cpu(), expected)


def test_tensors_of_two_devices_in_one_kernel_fail_as_on_a_gpu(fake_cuda):
    a, b = torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)  # a weight left on the host
    assert float((a + torch.tensor(2.0)).sum()) == 9.0  # a 0-dim host tensor is a scalar to CUDA


def test_a_copy_on_a_side_stream_races_with_its_use_until_waited_for(fake_cuda):
    fake_cuda.expect_races = True
    side = torch.cuda.Stream("cuda:0")
    weights = torch.empty(16, device="cuda:0")
    with torch.cuda.stream(side):
        weights.copy_(torch.ones(16), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    weights * 2
    assert _ops(fake_cuda) == ["write copy_ h2d || read mul.Tensor"]
    torch.cuda.current_stream().wait_event(copied)
    weights * 2
    assert fake_cuda.take() == []


def test_a_host_wait_orders_everything_enqueued_after_it(fake_cuda):
    side = torch.cuda.Stream("cuda:0")
    weights = torch.empty(16, device="cuda:0")
    with torch.cuda.stream(side):
        weights.copy_(torch.ones(16), non_blocking=True)
    side.synchronize()
    weights * 2  # fixture: no race


def test_memory_used_on_another_stream_then_freed_races_at_its_reuse(fake_cuda):
    # the caching allocator hands a freed block to the next allocation on the stream it was allocated on at once
    fake_cuda.expect_races = True
    side = torch.cuda.Stream("cuda:0")
    for waits in (False, True):
        block = torch.ones(256, device="cuda:0")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block.sum()  # read on the side stream
        if waits:
            torch.cuda.current_stream().wait_stream(side)  # what record_stream would arrange
        del block
        again = torch.zeros(256, device="cuda:0")  # the same block, written on the default stream
        assert _ops(fake_cuda) == ([] if waits else ["read sum.default || write zeros"])
        del again


def test_the_current_stream_is_per_thread_and_per_device(fake_cuda):
    mine = torch.cuda.Stream("cuda:1")
    seen = {}
    with torch.cuda.stream(mine):
        assert torch.cuda.current_stream("cuda:1") == mine and torch.cuda.current_device() == 1
        assert torch.cuda.current_stream("cuda:0") == torch.cuda.default_stream("cuda:0")
        thread = threading.Thread(target=lambda: seen.update(stream=torch.cuda.current_stream("cuda:1")))
        thread.start()
        thread.join()
    assert seen["stream"] == torch.cuda.default_stream("cuda:1") != mine
    assert torch.cuda.current_device() == 0


def test_a_copy_between_gpus_is_fenced_with_both_current_streams(fake_cuda):
    # Copy.cu: on the source's current stream, after the destination's current stream, which then waits for it
    fake_cuda.expect_races = True
    caller = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(caller):
        x = torch.ones(8, device="cuda:0") * 3
    other = threading.Thread(target=lambda: x.to("cuda:1"))  # its cuda:0 stream is the default one, not caller
    other.start()
    other.join()
    assert _ops(fake_cuda) == ["write mul.Tensor || read to_copy p2p"]
    with torch.cuda.stream(caller):
        y = torch.ones(8, device="cuda:0") * 3
        moved = y.to("cuda:1")
    moved + 1  # on cuda:1's default stream, which waited for the copy
    assert fake_cuda.take() == []


def test_host_registration_answers_as_the_driver(fake_cuda):
    fake_cuda.expect_races = True
    cudart = torch.cuda.cudart()
    host = torch.empty(4096, dtype=torch.uint8)
    assert cudart.cudaHostRegister(host.data_ptr(), 4096, 1) == 0
    assert cudart.cudaHostRegister(host.data_ptr() + 1024, 1024, 1) == 712  # already registered
    assert cudart.cudaHostUnregister(host.data_ptr() + 1) == 713  # not registered
    torch.empty(4096, dtype=torch.uint8, device="cuda:0").copy_(host, non_blocking=True)
    assert cudart.cudaHostUnregister(host.data_ptr()) == 0
    assert _ops(fake_cuda) == ["read async copy from pinned memory || unregister cudaHostUnregister"]
    assert cudart.cudaHostRegister(host.data_ptr(), 4096, 1) == 0
    torch.empty(4096, dtype=torch.uint8, device="cuda:0").copy_(host, non_blocking=True)
    torch.cuda.synchronize("cuda:0")
    assert cudart.cudaHostUnregister(host.data_ptr()) == 0 and fake_cuda.take() == []


def test_the_allocator_counts_and_refuses_past_its_limit(fake_cuda):
    fake_cuda.limit[0] = 4 * MIB  # the cap is on reserved bytes: room for the small pool's 2 MiB segment only
    kept = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
    assert torch.cuda.memory_allocated(0) == 1024  # rounded to the allocator's 512-byte blocks
    assert torch.cuda.memory_reserved(0) == 2 * MIB
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(4 * MIB, dtype=torch.uint8, device="cuda:0")  # a large pool's 20 MiB segment
    del kept
    assert torch.cuda.memory_allocated(0) == 0 and torch.cuda.max_memory_allocated(0) == 1024


def test_every_replaced_function_takes_the_arguments_of_torch_cuda_by_their_names():
    """Callers pass ``device=`` by name (the ``kernels`` package that transformers 5.25 runs at load does): a fake
    that names its parameters otherwise breaks them on the fake only."""
    import inspect

    before = {name: getattr(torch.cuda, name) for name in dir(torch.cuda) if not name.startswith("_")}
    fake = fakecuda.install(gpus=2)
    try:
        replaced = {name: getattr(torch.cuda, name) for name in before if getattr(torch.cuda, name) is not before[name]}
    finally:
        fake.exit()
    functions = {name: fn for name, fn in replaced.items() if not inspect.isclass(before[name])}
    assert {"get_device_capability", "mem_get_info", "memory_allocated", "set_device"} <= set(functions)

    def names(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()]

    assert {name: names(fn) for name, fn in functions.items()} == {
        name: names(before[name]) for name in functions}


# ---- as strict as CUDA (issue 35) ----------------------------------------------------------------------------------


def test_a_host_write_into_pinned_memory_a_copy_still_reads_races(fake_cuda):
    fake_cuda.expect_races = True
    staging = torch.empty(4096, dtype=torch.uint8, pin_memory=True)  # the pinned host allocator's
    staging.fill_(1)
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        torch.empty(4096, dtype=torch.uint8, device="cuda:0").copy_(staging, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    staging[2048:].fill_(2)  # refilled before the copy ran: a GPU may move the new bytes
    assert _ops(fake_cuda) == ["read async copy from pinned memory || write fill_"]
    done.synchronize()
    staging.fill_(3)  # after the host waited: ordered
    assert fake_cuda.take() == []


def test_pinned_host_blocks_stay_locked_in_the_cache_until_emptied(fake_cuda):
    staging = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    assert sum(fake_cuda.host_pinned.values()) == 4096
    del staging
    assert fake_cuda.host_pinned == {} and sum(fake_cuda.host_cached.values()) == 4096
    torch._C._host_emptyCache()
    assert fake_cuda.host_cached == {}


def test_out_of_memory_says_the_gpu_as_cuda_does(fake_cuda):
    from pipemap.runtime.admission import _GPU, _TRIED

    fake_cuda.limit[1] = 2**20
    with pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(2**21, dtype=torch.uint8, device="cuda:1")
    # CUDA names the segment it asked cudaMalloc for: a 2 MiB request gets a 20 MiB one
    assert _GPU.search(str(err.value))[1] == "1" and _TRIED.search(str(err.value))[0] == "Tried to allocate 20.00 MiB"


def test_streams_come_from_a_pool_of_32_per_device_and_priority(fake_cuda):
    streams = [torch.cuda.Stream(0) for _ in range(fakecuda.POOLED_STREAMS + 1)]
    assert len(set(streams)) == 32 and streams[32] is streams[0]
    assert torch.cuda.Stream(0, priority=-1) not in streams and torch.cuda.Stream(1) not in streams
    assert torch.cuda.current_stream(0) not in streams  # the default stream is not pooled


def test_a_sticky_error_fails_every_later_call(fake_cuda):
    x = torch.ones(4, device="cuda:0")
    fake_cuda.fail_sticky()
    for later in (lambda: x + 1, lambda: torch.ones(4, device="cuda:1"), torch.cuda.synchronize):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            later()
    fake_cuda.sticky = None  # the fixture's own checks run after


def test_a_corrupting_peer_pair_copies_zeros_between_those_gpus_only(fake_cuda):
    fake_cuda.corrupt_pairs.add((0, 1))
    x = torch.full((8,), 5.0, device="cuda:0")
    assert fakecuda.host(x.to("cuda:1")).eq(0).all()  # the direct copy: wrong bytes, no error
    assert fakecuda.host(x.cpu().to("cuda:1")).eq(5).all()  # through the host: right
    assert fakecuda.host(x.to("cuda:1").to("cuda:0")).eq(0).all()
    assert fakecuda.host(torch.full((8,), 5.0, device="cuda:1").to("cuda:0")).eq(5).all()  # the other way: right


# every form of `.to` diffusers and transformers write (load_lora_weights: `text_encoder.to(device=..., dtype=...)`,
# pipelines: `.to(device)`, `.to(device=device, dtype=dtype)`, `.to(dtype)`), on a module and on a tensor: each lands
# where the real CUDA puts it (issue 39: a `device=` keyword was taken for a factory's and put the module on the CPU)
_TO_FORMS = {
    "positional string": (("cuda:1",), {}),
    "positional device": ((torch.device("cuda:1"),), {}),
    "device keyword": ((), {"device": torch.device("cuda:1")}),
    "device keyword string": ((), {"device": "cuda:1"}),
    "device and dtype keywords": ((), {"device": torch.device("cuda:1"), "dtype": torch.float64}),
    "device and dtype positional": (("cuda:1", torch.float64), {}),
    "device positional, dtype keyword": ((torch.device("cuda:1"),), {"dtype": torch.float64}),
    "non_blocking": (("cuda:1",), {"non_blocking": True}),
}


@pytest.mark.parametrize("form", list(_TO_FORMS))
def test_every_to_form_lands_where_cuda_puts_it(fake_cuda, form):
    args, kwargs = _TO_FORMS[form]
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), torch.float32))
    layer = torch.nn.Linear(2, 2).to("cuda:0")
    assert layer.to(*args, **kwargs) is layer
    assert (layer.weight.device, layer.weight.dtype) == (torch.device("cuda:1"), dtype)
    assert fakecuda.on_device(layer.weight)
    tensor = torch.ones(2).to(*args, **kwargs)
    assert (tensor.device, tensor.dtype) == (torch.device("cuda:1"), dtype) and fakecuda.on_device(tensor)


def test_a_to_naming_a_dtype_or_a_tensor_keeps_or_follows_the_device(fake_cuda):
    layer = torch.nn.Linear(2, 2).to(device="cuda:1")
    layer.to(torch.float64)  # a dtype alone: stays on its GPU
    assert (layer.weight.device, layer.weight.dtype) == (torch.device("cuda:1"), torch.float64)
    like = torch.ones(1, device="cuda:0", dtype=torch.float16)
    assert torch.ones(2).to(like).device == torch.device("cuda:0")
    layer.to(device=torch.device("cpu"))
    assert layer.weight.device == torch.device("cpu") and not fakecuda.on_device(layer.weight)


# ---- the caching allocator's segments: the cap is on reserved memory (issue 35) ------------------------------------


def _empty(nbytes: int, stream=None) -> torch.Tensor:
    with torch.cuda.stream(stream):
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")


def test_requests_are_served_from_segments_of_the_pool_their_size_picks(fake_cuda):
    small = [_empty(1000) for _ in range(3)]  # up to 1 MiB: packed into one 2 MiB segment
    assert (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)) == (3 * 1024, 2 * MIB)
    large = _empty(3 * MIB)  # 1-10 MiB: a 20 MiB segment, split
    assert torch.cuda.memory_reserved(0) == 22 * MIB and torch.cuda.memory_allocated(0) == 3 * 1024 + 3 * MIB
    _empty(2 * MIB)  # from the rest of that segment: nothing new reserved (and freed at once)
    huge = _empty(18 * MIB + 1)  # 10 MiB and over, past the 17 MiB rest: a segment of its own, rounded to 2 MiB
    assert torch.cuda.memory_reserved(0) == 42 * MIB and torch.cuda.max_memory_reserved(0) == 42 * MIB
    assert torch.cuda.memory_allocated(0) == 3 * 1024 + 3 * MIB + 18 * MIB + 512
    del small, large, huge
    assert torch.cuda.memory_allocated(0) == 0 and torch.cuda.memory_reserved(0) == 42 * MIB  # cached
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(0) == 0 and torch.cuda.max_memory_reserved(0) == 42 * MIB


def test_fragmentation_fails_an_allocation_that_fits_in_allocated_terms(fake_cuda):
    fake_cuda.limit[0] = 100 * MIB
    whole = _empty(95 * MIB)
    del whole  # a 96 MiB segment, cached
    parts = [_empty(30 * MIB) for _ in range(3)]  # split from it: nothing new reserved
    assert torch.cuda.memory_reserved(0) == 96 * MIB
    del parts[1]  # 30 MiB free in the middle, 6 MiB at the end: no 40 MiB run, and the segment cannot be released
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 40.00 MiB. GPU 0 .* 60.00 MiB is allocated"):
        _empty(40 * MIB)
    assert torch.cuda.memory_allocated(0) == 60 * MIB < 100 * MIB - 40 * MIB + 1
    torch.cuda.empty_cache()  # a split segment is not returned
    assert torch.cuda.memory_reserved(0) == 96 * MIB
    del parts
    torch.cuda.empty_cache()  # its blocks merged back into the whole segment: returned
    assert torch.cuda.memory_reserved(0) == 0
    kept = _empty(40 * MIB)
    assert torch.cuda.memory_reserved(0) == 40 * MIB and kept.numel() == 40 * MIB


def test_a_new_segment_past_the_cap_first_releases_the_cached_whole_ones(fake_cuda):
    fake_cuda.limit[0] = 50 * MIB
    del [_empty(30 * MIB)][0]  # cached: reserved 30 MiB, nothing allocated
    kept = _empty(40 * MIB)  # 30 + 40 > 50: the cached segment goes back to the device, then this one fits
    assert torch.cuda.memory_reserved(0) == 40 * MIB and kept.numel() == 40 * MIB


def test_a_freed_block_returns_to_its_streams_pool_only(fake_cuda):
    side = torch.cuda.Stream(0)
    fake_cuda.limit[0] = 30 * MIB
    del [_empty(12 * MIB, side)][0]  # a 12 MiB segment, cached in the side stream's pool
    again = _empty(12 * MIB, side)  # the side stream takes it back: nothing new
    assert torch.cuda.memory_reserved(0) == 12 * MIB
    del again
    kept = _empty(12 * MIB)  # the default stream cannot: a second segment
    assert torch.cuda.memory_reserved(0) == 24 * MIB
    with pytest.raises(torch.OutOfMemoryError):
        _empty(8 * MIB)  # 20 MiB more: past the cap, though the side stream caches 12 MiB ... which is whole:
    assert torch.cuda.memory_reserved(0) == 12 * MIB  # ... released by the retry, still short of 20 MiB
    del kept


def test_mem_get_info_counts_reserved_memory_as_the_device_does(fake_cuda):
    fake_cuda.limit[0] = 64 * MIB
    kept = _empty(1000)
    assert torch.cuda.mem_get_info(0) == (62 * MIB, fake_cuda.memory)
    del kept
