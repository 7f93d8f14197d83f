"""inventory/trees.py: a component's module tree from tensor names and bytes."""

from __future__ import annotations

import torch

from helpers import plain_pipeline
from pipemap.inventory.live import tensor_sizes
from pipemap.inventory.trees import block_tree


def test_block_tree_from_headers_is_the_module_tree(tiny_folders):
    """A tree from tensor names has a block per module holding tensors (or holding one that does), each with its
    subtree's bytes, children in natural order (``blocks.10`` after ``blocks.9``)."""
    pipe = plain_pipeline(tiny_folders["sd"])
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        sizes = tensor_sizes(module)
        tree, paths = block_tree(sizes), []
        stack = [tree]
        while stack:
            block = stack.pop()
            paths.append(block.path)
            assert block.bytes == block.own + sum(c.bytes for c in block.children)
            names = [c.path.rpartition(".")[2] for c in block.children]
            assert names == sorted(names, key=lambda p: (not p.isdigit(), int(p) if p.isdigit() else 0, p))
            stack.extend(block.children)
        holding = {""} | {key.rpartition(".")[0] for key in sizes}  # the modules holding a saved tensor
        for path in list(holding):
            while path:
                path = path.rpartition(".")[0]
                holding.add(path)  # and every module above one
        assert sorted(paths) == sorted(holding), name
        assert holding <= {n for n, _ in module.named_modules()}
        assert tree.bytes >= sum(sizes.values())  # each tensor aligned as in a streaming buffer
