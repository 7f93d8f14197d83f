"""The one way pipemap moves tensors between devices.

Every tensor the dispatcher and its hooks move goes through ``move``/``move_tensor``, so that a GPU pair whose
direct copies are unsafe can be routed through CPU memory in one place.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import torch

# Pairs (source, destination) whose direct copies must be staged through CPU memory; filled by check_transfers.
_STAGED: set[tuple[str, str]] = set()


def move_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when already there, staged through the CPU for an unsafe GPU pair."""
    if tensor.device == device:
        return tensor
    if _STAGED and (str(tensor.device), str(device)) in _STAGED:
        return tensor.to("cpu").to(device)
    return tensor.to(device)


def move(obj, device: torch.device | str):
    """``obj`` with every tensor in it on ``device``: tensors, lists, tuples, dicts, model outputs, and diffusers'
    small result objects (a VAE's ``latent_dist``). Returns ``obj`` itself when nothing had to move.

    accelerate's ``send_to_device`` rebuilds every container on each call and does not reach into diffusers'
    ``DiagonalGaussianDistribution``; hooks run at every denoising step, so this one returns inputs untouched when
    they are already in place.
    """
    return _move(obj, torch.device(device) if isinstance(device, str) else device)


def _move(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return move_tensor(obj, device)
    if isinstance(obj, (list, tuple)):
        items = [_move(x, device) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, Mapping):
        moved = {k: _move(v, device) for k, v in obj.items()}
        if all(moved[k] is v for k, v in obj.items()):
            return obj
        if dataclasses.is_dataclass(obj):
            return dataclasses.replace(obj, **moved)
        return type(obj)(moved) if type(obj) is not dict else moved
    if _is_result_object(obj):
        return _move_attributes(obj, device)
    return obj


def _is_result_object(obj) -> bool:
    # diffusers' distribution objects (DiagonalGaussianDistribution, IdentityDistribution) hold their tensors as
    # plain attributes and have no .to(); other objects are left alone.
    return type(obj).__module__.startswith("diffusers.") and not isinstance(obj, torch.nn.Module) and hasattr(
        obj, "__dict__")


def _move_attributes(obj, device: torch.device):
    moved = {k: _move(v, device) for k, v in vars(obj).items()}
    if all(moved[k] is v for k, v in vars(obj).items()):
        return obj
    clone = copy.copy(obj)
    vars(clone).update(moved)
    return clone
