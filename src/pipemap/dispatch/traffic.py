"""Weights moved for one image: a pipemap plan beside diffusers' ``enable_model_cpu_offload`` on the same pipeline.

A measurement above ``dispatch`` and ``offload`` (it dispatches, runs, and resets), kept out of both so that neither
imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from accelerate.hooks import CpuOffload

from ..hooks import Moved
from ..hooks.packing import nbytes_of, slots
from ..plan import Plan
from .counters import stats
from .placing import dispatch
from .resetting import reset

# ---- bytes moved, beside diffusers' model offload ----------------------------------------------------------------


@dataclass(frozen=True)
class MovedBytes:
    """Weights moved for one image under a pipemap plan and under diffusers' ``enable_model_cpu_offload``."""

    pipemap: dict[str, dict[str, int]]
    diffusers: dict[str, dict[str, int]]

    @property
    def pipemap_bytes(self) -> int:
        return total_bytes(self.pipemap)

    @property
    def diffusers_bytes(self) -> int:
        return total_bytes(self.diffusers)

    @property
    def ratio(self) -> float:
        """pipemap's bytes over diffusers': at most 1.0 (0.0 when everything fits)."""
        return self.pipemap_bytes / self.diffusers_bytes if self.diffusers_bytes else 0.0


def total_bytes(counts: Mapping[str, Mapping[str, int]]) -> int:
    return sum(c["h2d_bytes"] + c["d2h_bytes"] for c in counts.values())


def bytes_moved_per_image(pipe, plan: Plan, **call) -> MovedBytes:
    """Weights moved by one image of ``pipe(**call)`` under ``plan`` (the second image, so caches are warm) and under
    diffusers' ``enable_model_cpu_offload`` on the same pipeline; ``pipe`` is left as it was.

    >>> plan = pipemap.plan(pipe, hardware="cuda:0=8GiB", strategy="balanced_low_memory")      # doctest: +SKIP
    >>> bytes_moved_per_image(pipe, plan, prompt="a cat", num_inference_steps=4).ratio          # doctest: +SKIP
    0.04
    """
    dispatch(pipe, plan)
    try:
        pipe(**call)
        stats(pipe, reset=True)
        pipe(**call)
        ours = stats(pipe)
    finally:
        reset(pipe)
    device = plan.execution_device if plan.execution_device.startswith("cuda") else "cpu"
    return MovedBytes(ours, model_offload_stats(pipe, device, **call))


def model_offload_stats(pipe, device: str = "cpu", **call) -> dict[str, dict[str, int]]:
    """What diffusers' ``enable_model_cpu_offload(device=device)`` moves in one ``pipe(**call)``, per component.

    accelerate's ``CpuOffload`` hooks are counted by their own rule: a model not on the device is moved there at its
    call, the previous model of ``model_cpu_offload_seq`` is moved back then, and whatever is still on the device is
    moved back at the end of the call. On the CPU the moves themselves do nothing; they are counted all the same.
    The hooks are removed afterwards.
    """
    counts = {n: Moved() for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    extra = set(pipe.__dict__)
    with _counting_cpu_offload(pipe, counts):
        pipe.enable_model_cpu_offload(device=device)
        pipe(**call)
    pipe.remove_all_hooks()
    for name in set(pipe.__dict__) - extra:
        del pipe.__dict__[name]
    for module in pipe.components.values():
        forward = getattr(module, "__dict__", {}).get("forward")
        if isinstance(module, torch.nn.Module) and getattr(forward, "__func__", None) is type(module).forward:
            del module.__dict__["forward"]  # accelerate leaves the class's forward bound on the instance
    return {n: dataclasses.asdict(c) for n, c in counts.items()}


@contextlib.contextmanager
def _counting_cpu_offload(pipe, counts: dict[str, Moved]):
    names = {id(m): n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    sizes = {id(m): sum(nbytes_of(s.get()) for s in slots(m.modules()).values())
             for m in pipe.components.values() if isinstance(m, torch.nn.Module)}
    on_device: set[int] = set()
    original_init, original_pre = CpuOffload.init_hook, CpuOffload.pre_forward

    def back(module) -> None:
        if id(module) in on_device:
            on_device.discard(id(module))
            counts[names[id(module)]].d2h_bytes += sizes[id(module)]

    def init_hook(hook, module):  # also what UserCpuOffloadHook.offload and the end-of-call re-hooking run
        back(module)
        return original_init(hook, module)

    def pre_forward(hook, module, *args, **kwargs):
        counts[names[id(module)]].calls += 1
        if hook.prev_module_hook is not None:
            back(hook.prev_module_hook.model)
        if id(module) not in on_device:
            on_device.add(id(module))
            counts[names[id(module)]].h2d_bytes += sizes[id(module)]
        return original_pre(hook, module, *args, **kwargs)

    CpuOffload.init_hook, CpuOffload.pre_forward = init_hook, pre_forward
    try:
        yield
    finally:
        CpuOffload.init_hook, CpuOffload.pre_forward = original_init, original_pre
