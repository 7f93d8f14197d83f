"""Denoiser replicas run under the caller's per-thread state: autocast, grad and inference mode, and on CUDA its
current streams (under the fake CUDA, tests/fakecuda.py), so their copies are ordered with the caller's work; a
call whose home part fails leaves nothing pending."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers import assert_split_close
from pipemap.dispatch import place_module
from pipemap.hooks import ReplicaHook, hook_component, unhook_component
from pipemap.hooks.calls import CallerState, replica


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.fail = False

    def forward(self, x):
        if self.fail and x.shape[0] == 1:  # the home part (the first half of the batch) fails
            raise torch.OutOfMemoryError("CUDA out of memory on the home GPU (simulated)")
        return self.b(torch.nn.functional.gelu(self.a(x)))


def _replicated(device: str = "cpu", copies: tuple[str, ...] = ("cpu",)) -> tuple[Denoiser, Denoiser, ReplicaHook]:
    torch.manual_seed(0)
    plain, net = Denoiser(), Denoiser()
    net.load_state_dict(plain.state_dict())
    place_module(net, device)
    hook = ReplicaHook("unet", device, device, copies)
    hook_component(net, hook)
    return plain, net, hook


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_part_runs_under_the_callers_autocast(dtype):
    plain, net, _ = _replicated()
    x = torch.randn(2, 64)
    with torch.autocast("cpu", dtype=dtype):
        expected, got = plain(x), net(x)
    assert got.dtype == expected.dtype == dtype
    assert_split_close(got, expected)  # 2 rows whole, 1 + 1 in parts
    unhook_component(net)


def test_every_part_runs_under_the_callers_grad_and_inference_mode():
    _, net, _ = _replicated()
    with torch.inference_mode():
        out = net(torch.randn(2, 64))
    assert out.is_inference() and not out.requires_grad
    with torch.no_grad():
        assert not net(torch.randn(2, 64)).requires_grad
    unhook_component(net)


def test_calls_whose_home_part_fails_leave_nothing_pending():
    _, net, hook = _replicated()
    net.fail = True
    for _ in range(3):
        with pytest.raises(torch.OutOfMemoryError):
            net(torch.randn(2, 64))
    assert hook._pending == []
    net.fail = False
    assert net(torch.randn(2, 64)).shape == (2, 64)
    unhook_component(net)


def _on_caller_stream(net: Denoiser) -> torch.Tensor:
    caller = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(caller):
        latents = torch.linspace(-1, 1, 128).reshape(2, 64).to("cuda:0") * 2  # the caller's work on its stream
        out = net(latents) + 1  # and what it does next with the joined output
        return out.cpu()


def test_a_caller_chosen_stream_orders_the_copies_into_and_out_of_the_replica(fake_cuda):
    plain, net, _ = _replicated("cuda:0", ("cuda:1",))
    out = _on_caller_stream(net)
    torch.testing.assert_close(out, plain(torch.linspace(-1, 1, 128).reshape(2, 64) * 2) + 1)
    assert replica(net, torch.device("cuda:1")).a.weight.device == torch.device("cuda:1")
    unhook_component(net)


def test_a_replica_thread_on_its_default_streams_races_with_the_caller(fake_cuda, monkeypatch):
    # the defect this replaces: the pool thread's own streams, not the caller's (here the caller chose one on each
    # GPU; the copies in and out are made in the caller's thread, on its streams)
    fake_cuda.expect_races = True
    capture = CallerState.capture
    monkeypatch.setattr(CallerState, "capture", classmethod(lambda cls, devices: capture(())))
    _, net, _ = _replicated("cuda:0", ("cuda:1",))
    with torch.cuda.stream(torch.cuda.Stream("cuda:1")):
        _on_caller_stream(net)
    races = {(r.earlier.kind, r.earlier.op, r.later.kind, r.later.op) for r in fake_cuda.take()}
    assert races == {("write", "to_copy p2p", "read", "addmm.default"),  # the replica's part, before its input came
                     ("write", "addmm.default", "read", "to_copy p2p")}  # the copy out, before the part finished
    unhook_component(net)


def test_a_replicas_inputs_are_copied_in_the_callers_thread_before_the_home_part(fake_cuda, monkeypatch):
    # N6r: a pool thread's copy lands on the caller's stream wherever the caller has got to (here: after the home
    # part, the pool thread held up as a busy host holds it), and the replica's part waits for that much of it
    entered = CallerState.entered

    def late(state, device):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        return entered(state, device)

    monkeypatch.setattr(CallerState, "entered", late)
    plain, net, _ = _replicated("cuda:0", ("cuda:1",))
    order: list[str] = []  # the caller's copies and kernels on cuda:0, from the call on
    access = fake_cuda.access
    monkeypatch.setattr(fake_cuda, "access", lambda stream, reads, writes, op: (
        order.append(op) if stream.device_index == 0 and op in ("to_copy p2p", "addmm.default") else None,
        access(stream, reads, writes, op))[1])
    out = _on_caller_stream(net)
    torch.testing.assert_close(out, plain(torch.linspace(-1, 1, 128).reshape(2, 64) * 2) + 1)
    assert order == ["to_copy p2p", "addmm.default", "addmm.default"]  # the copy in, then the home part
    unhook_component(net)


def test_a_replicas_output_is_copied_home_where_the_caller_joins_it(fake_cuda, monkeypatch):
    # G2: copied out from a pool thread that is ahead, the output would make the caller's stream wait for the whole
    # replica part at whatever point the caller had reached (here: before the home part's kernels)
    plain, net, _ = _replicated("cuda:0", ("cuda:1",))
    net.a.register_forward_pre_hook(lambda module, args: time.sleep(0.2))  # the home copy's only: a slow caller
    order: list[str] = []
    access = fake_cuda.access
    monkeypatch.setattr(fake_cuda, "access", lambda stream, reads, writes, op: (
        order.append(f"{op} on cuda:{stream.device_index}") if op in ("to_copy p2p", "addmm.default") else None,
        access(stream, reads, writes, op))[1])
    out = _on_caller_stream(net)
    torch.testing.assert_close(out, plain(torch.linspace(-1, 1, 128).reshape(2, 64) * 2) + 1)
    home = [o for o in order if o in ("addmm.default on cuda:0", "to_copy p2p on cuda:1")]
    assert home == ["addmm.default on cuda:0", "addmm.default on cuda:0", "to_copy p2p on cuda:1"]  # then the join
    unhook_component(net)
