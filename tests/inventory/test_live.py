"""inventory/live.py: walking live modules: the stack walk yields what torch's walk yields, in its order."""

from __future__ import annotations

import torch

from helpers import plain_pipeline
from pipemap.inventory.live import near_submodules, submodules


def _shared_and_empty() -> torch.nn.Module:
    """A module tree torch's walk has rules for: a submodule reached twice (once deeper first) and an empty slot."""
    shared, root, inner = torch.nn.Linear(2, 2), torch.nn.Module(), torch.nn.Sequential(torch.nn.ReLU())
    inner.add_module("deep", shared)
    root.add_module("a", torch.nn.Sequential(inner, torch.nn.Tanh()))
    root.add_module("shared", shared)
    root.register_module("empty", None)
    return root


def test_submodules_walk_as_torch_does(tiny_folders):
    """The stack walk dispatch and follow use yields what ``module.modules()`` yields, in its order; the near walk
    yields each module within the depth once, as ``named_modules()`` has them."""
    pipe = plain_pipeline(tiny_folders["sdxl"])
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)] + [_shared_and_empty()]
    for module in modules:
        assert [id(m) for m in submodules(module)] == [id(m) for m in module.modules()]
    for module in modules[:-1]:  # no module shared: every module within the depth is there, at its own path
        named = [m for name, m in module.named_modules() if name and name.count(".") < 2]
        near = [id(m) for m in near_submodules(module, 2)]
        assert len(near) == len(set(near)) and set(near) == {id(m) for m in named}
    near = near_submodules(modules[-1], 2)
    assert len(near) == len({id(m) for m in near}) == 4  # a, a.0, a.1, shared: once, though also 3 levels down
