"""Atomic dispatch, by fault injection: a failure at any tensor of any component, split shards included, leaves
every tensor of the pipeline where and what it was, and no hook behind.

The tiny SD pipeline (real weights) is dispatched onto two stand-in GPUs (``meta:0``, ``meta:1``) with its UNet
split between them, so every tensor really moves, and cheaply. ``dispatch`` refuses a stand-in plan for real
weights (their data would be lost on success); this test lifts that guard, since what it checks is the undo.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

import pipemap
from pipemap import tiny
from pipemap.planner import forcing_hardware

dispatch_module = importlib.import_module("pipemap.dispatch")  # the module: pipemap.dispatch is the function
STANDINS = {"cuda:0": "meta:0", "cuda:1": "meta:1"}


@pytest.fixture(scope="module")
def pipe_and_plan():
    pipe = tiny.build("sd")  # its own copy: the final, successful dispatch leaves it on meta
    inv = pipemap.inspect(pipe)
    spec = forcing_hardware(inv, "balanced_split", gpus=2)
    plan = pipemap.plan(inv, hardware=spec, strategy="balanced_split", headroom=0.0).remap(STANDINS)
    assert any(p.shards for p in plan.components), plan  # the split really cuts a component across both stand-ins
    return pipe, plan


def state(pipe) -> dict:
    """Every tensor slot of every component (which tensor object, its device, its values) and every hook trace."""
    slots: dict = {"pipe": sorted(pipe.__dict__)}
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        for path, sub in module.named_modules():
            for store in ("_parameters", "_buffers"):
                for key, tensor in getattr(sub, store).items():
                    storage = None if tensor is None or tensor.is_meta else tensor.untyped_storage().data_ptr()
                    slots[(name, path, store, key)] = (id(tensor), getattr(tensor, "device", None), storage)
            slots[(name, path, "hook")] = (getattr(sub, "_hf_hook", None), sorted(sub.__dict__))
    return slots


def values(pipe) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.detach().clone() for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)
            for k, v in m.state_dict().items()}


def failing_at(position: int, real):
    calls = itertools.count()

    def move_tensor(tensor, device):
        if next(calls) == position:
            raise RuntimeError(f"injected failure at tensor {position}")
        return real(tensor, device)

    return move_tensor


@pytest.mark.slow
def test_a_failure_at_every_tensor_restores_everything(pipe_and_plan, monkeypatch):
    pipe, plan = pipe_and_plan
    monkeypatch.setattr(dispatch_module, "_check_standins", lambda modules, plan: None)
    before, real, weights = state(pipe), dispatch_module.move_tensor, values(pipe)
    for position in itertools.count():
        monkeypatch.setattr(dispatch_module, "move_tensor", failing_at(position, real))
        try:
            pipemap.dispatch(pipe, plan, check_transfers=False)
        except pipemap.DispatchError as err:
            assert f"injected failure at tensor {position}" in str(err) and "restored as it was" in str(err)
            assert err.component in plan.device_map
            assert state(pipe) == before, f"a failure at tensor {position} left the pipeline changed"
            if position % 64 == 0:  # the same storages, so the same values; checked outright now and then
                torch.testing.assert_close(values(pipe), weights, rtol=0, atol=0)
            continue
        break  # the position is past the last tensor: this dispatch moved everything
    after = state(pipe)
    moved = [k for k in before if len(k) == 4 and after[k][1] != before[k][1]]
    assert position == len(moved) > 100  # a failure injected at each tensor that moves, and there are many
    shards = {(p.component, path) for p in plan.components for path, _, _ in p.shards}
    assert any(c == shard_c and (path + ".").startswith(shard + ".")
               for c, path, *_ in moved for shard_c, shard in shards)  # split shards' tensors were among them
