"""A resident component (``hooks/resident.py``): ``PlacementHook`` moves inputs to its device and outputs to the
execution device; ``hook_component`` attaches a hook (with the VAE methods and the call lock) and
``unhook_component`` removes every trace of it."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.utils.accelerate_utils import apply_forward_hook

import pipemap
from helpers import moving, plain_pipeline
from pipemap.hooks import CallLock, PlacementHook, hook_component, unhook_component
from pipemap.plan import Placement

# ---- PlacementHook -----------------------------------------------------------------------------------------------


def test_inputs_go_to_the_components_device_and_outputs_to_the_execution_device():
    hook = PlacementHook("unet", "meta", "cpu")  # meta: a device apart from the CPU, with no GPU
    args, kwargs = hook.pre_forward(None, torch.ones(2), [torch.ones(1)], added={"time": torch.ones(3)}, steps=3)
    assert [args[0].device.type, args[1][0].device.type, kwargs["added"]["time"].device.type] == ["meta"] * 3
    assert kwargs["steps"] == 3 and hook.moved.calls == 1
    back = PlacementHook("vae", "cpu", "meta").post_forward(None, DecoderOutput(sample=torch.ones(2)))
    assert isinstance(back, DecoderOutput) and back.sample.device.type == "meta"  # the output class kept


def test_for_placement_takes_the_placements_device_and_the_plans_execution_device():
    hook = PlacementHook.for_placement(Placement("vae", "cuda:1", 20), "cuda:0", None)
    assert (hook.component, hook.device, hook.execution_device) == ("vae", torch.device("cuda:1"),
                                                                    torch.device("cuda:0"))
    assert repr(hook) == "PlacementHook('vae', device=cuda:1, execution_device=cuda:0)"


# ---- hook_component and unhook_component ---------------------------------------------------------------------------


class TinyVae(torch.nn.Module):
    """A module with a diffusers-style ``decode`` (run through ``apply_forward_hook``) beside its ``forward``."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.linear(x)

    @apply_forward_hook
    def decode(self, z):
        return DecoderOutput(sample=self.linear(z))


def _trace(module: torch.nn.Module) -> tuple:
    return (sorted(module.__dict__), dict(module.__dict__), [(len(m._forward_pre_hooks), len(m._forward_hooks))
                                                             for m in module.modules()])


def test_hook_component_counts_forward_and_decode_once_each_and_unhook_leaves_no_trace():
    vae = TinyVae()
    before = _trace(vae)
    hook = PlacementHook("vae", "cpu", "cpu")
    hook_component(vae, hook)
    assert "decode" in vae.__dict__ and "forward" in vae.__dict__
    z = torch.ones(1, 2)
    # the reference by the functional form: ``vae.linear(z)`` from outside is a call of the component (issue 28)
    expected = torch.nn.functional.linear(z, vae.linear.weight, vae.linear.bias)
    torch.testing.assert_close(vae.decode(z).sample, expected, atol=0, rtol=0)
    vae(z)
    assert hook.moved.calls == 2  # the decode once (not again through apply_forward_hook's own pre_forward)
    unhook_component(vae)
    assert _trace(vae) == before and not hasattr(vae, "_hf_hook")
    vae.decode(z)
    assert hook.moved.calls == 2


class Aborting(PlacementHook):
    aborted = 0

    def abort(self, module):
        self.aborted += 1


def test_a_call_that_raises_tells_the_hook_and_unhook_removes_that_too():
    vae, hook = TinyVae(), Aborting("vae", "cpu", "cpu")
    before = _trace(vae)
    hook_component(vae, hook)
    with pytest.raises(RuntimeError):
        vae(torch.ones(1, 3))  # the wrong width
    with pytest.raises(RuntimeError):
        vae.decode(torch.ones(1, 3))
    assert hook.aborted == 2
    vae(torch.ones(1, 2))
    assert hook.aborted == 2  # a call that returns is no abort
    unhook_component(vae)
    assert _trace(vae) == before


def test_a_components_calls_from_two_threads_take_turns():
    vae, hook = TinyVae(), PlacementHook("vae", "cpu", "cpu")
    hook_component(vae, hook)
    inside, other_in = threading.Event(), []
    other = threading.Thread(target=lambda: vae(torch.ones(1, 2)))

    def first_call(module, args):
        if threading.current_thread() is threading.main_thread() and not other_in:
            other.start()
            other_in.append(inside.wait(timeout=0.5))  # the other call must not get in while this one runs

    handles = [vae.linear.register_forward_pre_hook(first_call),
               vae.linear.register_forward_pre_hook(
                   lambda m, a: inside.set() if threading.current_thread() is other else None)]
    vae(torch.ones(1, 2))
    other.join()
    for handle in handles:
        handle.remove()
    assert other_in == [False] and inside.is_set() and hook.moved.calls == 2
    unhook_component(vae)


# ---- CallLock ----------------------------------------------------------------------------------------------------


def test_call_lock_copies_are_new_locks():
    lock = CallLock()
    with lock:
        other = copy.deepcopy(lock)
        assert other._lock.acquire(blocking=False)  # not the held one
        other._lock.release()


def test_call_lock_is_reentrant():
    lock = CallLock()
    with lock, lock:  # a decode calling the component's forward, in one thread
        pass
    assert lock._lock.acquire(blocking=False)
    lock._lock.release()


# ---- every mode counts one call per VAE decode -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stream", "offload", "resident"])
def test_stats_count_one_call_per_vae_decode(tiny_folders, sd_plan, sd_inventory, mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    vae = sd_plan.placement("vae")
    plan = moving(sd_plan, sd_inventory, {"vae": (mode, "cuda:1")}) if mode != "resident" else dataclasses.replace(
        sd_plan, components=tuple(Placement("vae", "cuda:1", vae.bytes) if p is vae else p for p in sd_plan.components))
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    latents = torch.randn(1, pipe.vae.config.latent_channels, 8, 8)
    for _ in range(3):
        pipe.vae.decode(latents)
    assert pipemap.stats(pipe)["vae"]["calls"] == 3
    hook = pipe.vae._hf_hook
    if mode == "stream":  # every call ended: nothing left onloaded
        assert hook.depth == 0 and not any(g.loaded for g in [hook.root, *hook.blocks])
        assert hook.ledger.live["cpu"] == 0
    pipemap.reset(pipe)
