"""dispatch()/reset() on a pipeline in memory: outputs unchanged, one hook per component, atomic (a failure at any
tensor undone, by fault injection), fully undone."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module

import pipemap
from helpers import plain_pipeline, run
from pipemap import tiny
from pipemap.dispatch import planned
from pipemap.hooks import PlacementHook
from pipemap.plan import Placement
from pipemap.planner import forcing_hardware

TWO_GPUS = "cuda:0=5MiB,cuda:1=5MiB,cpu=1GiB"  # tiny models: unet 3.0 MiB, vae 2.5, controlnet 1.6, text encoders 0.2
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


def _models(pipe) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _state(pipe) -> dict:
    """Everything dispatch may touch: devices, tensor identities, hooks, instance attributes."""
    return {
        name: (sorted(module.__dict__), [(id(p), p.device) for p in module.parameters()],
               [m for m in module.modules() if hasattr(m, "_hf_hook")])
        for name, module in _models(pipe).items()
    } | {"pipe": sorted(pipe.__dict__), "map": pipe.hf_device_map}


@pytest.mark.parametrize("kind", ["sd", "sdxl", "controlnet"])
def test_dispatched_output_equals_plain(tiny_folders, reference_outputs, kind):
    pipe = plain_pipeline(tiny_folders[kind])
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0).remap(ON_CPU)
    pipemap.dispatch(pipe, plan)
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    assert pipe.hf_device_map == plan.device_map
    assert planned(pipe) == plan


def test_one_hook_per_component_at_its_root(tiny_folders):
    pipe = plain_pipeline(tiny_folders["controlnet"])
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hooked = [m for module in _models(pipe).values() for m in module.modules() if hasattr(m, "_hf_hook")]
    assert len(hooked) == len(_models(pipe))
    for name, module in _models(pipe).items():
        hook = module._hf_hook
        assert isinstance(hook, PlacementHook) and hook.component == name
        assert hook.execution_device == torch.device("cpu")


def test_execution_device_is_the_denoisers(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0)
    assert plan.execution_device == plan.device_map["unet"] == "cuda:0"
    assert plan.device_map["vae"] == "cuda:1"


def test_mapped_pipeline_refuses_to_and_diffusers_offload(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    pipemap.dispatch(pipe, pipemap.plan(pipe, hardware="cpu=1GiB"))
    for call in (lambda: pipe.to("cpu"), pipe.enable_model_cpu_offload, pipe.enable_sequential_cpu_offload):
        with pytest.raises(pipemap.PipelineMappedError, match=r"pipemap\.reset\(pipe\)") as err:
            call()
        assert err.value.operation.startswith("pipe.")
    pipe.reset_device_map()  # diffusers' own undo does pipemap's
    assert planned(pipe) is None and pipe.to("cpu") is pipe


def test_reset_leaves_no_trace(tiny_folders, reference_outputs):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    before = _state(pipe)
    pipemap.dispatch(pipe, pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0).remap(ON_CPU))
    assert "decode" in pipe.vae.__dict__
    pipemap.reset(pipe)
    assert _state(pipe) == before
    torch.testing.assert_close(run(pipe, "sdxl"), reference_outputs["sdxl"], atol=1e-5, rtol=0)


def test_failed_dispatch_restores_the_pipeline(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    before = _state(pipe)
    good = pipemap.plan(pipe, hardware="cpu=1GiB")
    # the last component goes to a device this machine cannot reach: the first two were already placed and hooked
    last = good.components[-1].component
    bad = pipemap.Plan(good.strategy, good.components[:-1] + (Placement(last, "cuda:5", 1),), good.devices, "cpu")
    with pytest.raises(pipemap.DispatchError) as err:
        pipemap.dispatch(pipe, bad)
    assert (err.value.component, err.value.device) == (last, "cuda:5")
    assert _state(pipe) == before


def test_plan_that_leaves_out_a_component_is_refused(tiny_folders):
    pipe = plain_pipeline(tiny_folders["controlnet"])
    without = pipemap.plan(pipemap.inspect(tiny_folders["sd"]), hardware="cpu=1GiB")
    before = _state(pipe)
    with pytest.raises(pipemap.PlanMismatchError) as err:
        pipemap.dispatch(pipe, without)
    assert err.value.component == "controlnet"
    assert _state(pipe) == before


def test_foreign_hooks_are_refused(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    add_hook_to_module(pipe.vae, AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(pipemap.PlanMismatchError, match="remove_all_hooks") as err:
        pipemap.dispatch(pipe, pipemap.plan(pipe, hardware="cpu=1GiB"))
    assert err.value.component == "vae"


def test_dispatch_twice_needs_reset(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = pipemap.plan(pipe, hardware="cpu=1GiB")
    pipemap.dispatch(pipe, plan)
    with pytest.raises(pipemap.PipelineMappedError):
        pipemap.dispatch(pipe, plan)
    pipemap.reset(pipe)
    pipemap.dispatch(pipe, plan)


def test_each_hook_knows_its_pipeline_and_checks_its_model_at_each_call(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    pipemap.dispatch(pipe, pipemap.plan(pipe, hardware="cpu=1GiB"))
    for module in _models(pipe).values():
        hook = module._hf_hook
        assert hook.owner() is pipe and hook.change_check(module) is False  # unchanged since it was placed
    pipemap.reset(pipe)


def test_replace_is_the_old_name_of_replace_component():
    assert pipemap.replace is pipemap.replace_component
    assert {"replace", "replace_component", "follow"} <= set(pipemap.__all__) & set(dir(pipemap))


# ---- atomic dispatch, by fault injection -------------------------------------------------------------------------
# A failure at any tensor of any component, split shards included, leaves every tensor of the pipeline where and what
# it was, and no hook behind. The tiny SD pipeline (real weights) is dispatched onto two stand-in GPUs (``meta:0``,
# ``meta:1``) with its UNet split between them, so every tensor really moves, and cheaply. ``dispatch`` refuses a
# stand-in plan for real weights (their data would be lost on success); this test lifts that guard, since what it
# checks is the undo.

checks_module = importlib.import_module("pipemap.dispatch.checks")
moves_module = importlib.import_module("pipemap.dispatch.moves")
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
    monkeypatch.setattr(checks_module, "check_standins", lambda modules, plan: None)
    before, real, weights = state(pipe), moves_module.move_tensor, values(pipe)
    for position in itertools.count():
        monkeypatch.setattr(moves_module, "move_tensor", failing_at(position, real))
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
