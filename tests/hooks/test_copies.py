"""A component with copies (guidance branches, sequence shards, replicas) changed after dispatch: its copies are made
again before the next call, so every branch computes with the new weights. On the CPU, where a copy shares the home
copy's tensors, a change that replaces them (``load_state_dict(assign=True)``, a LoRA's new layers); under the fake
CUDA (tests/fakecuda.py), where a copy on another GPU holds weights of its own, a change in place (``fuse_lora``)."""

from __future__ import annotations

import pytest
import torch

import pipemap
from families import fresh, output, true_cfg
from helpers import split_tolerance, with_copy

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
EXACT = {"atol": 0, "rtol": 0}
TOLERANCE = {"sequence": split_tolerance(operation="attention")}  # attention in shards sums in another order


def _scaled(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v * 1.5 for k, v in module.state_dict().items()}


# the tiny Qwen-Image's 3 attention heads do not divide among 2 shards: no sequence plan for it
@pytest.mark.parametrize(("name", "mode"), [("wan_t2v", "guidance"), ("wan_t2v", "sequence"), ("wan_t2v", "replicated"),
                                            ("qwen_image", "guidance"), ("qwen_image", "replicated")])
def test_copies_follow_weights_replaced_on_the_cpu(name, mode):
    pipe, call = true_cfg(name, steps=2)
    pipemap.dispatch(pipe, with_copy(pipe, mode).remap(ON_CPU))
    pipe(**fresh(call))
    copies = pipe.transformer._hf_hook.replicas
    pipe.transformer.load_state_dict(_scaled(pipe.transformer), assign=True)  # new tensors in place of the old
    changed = output(pipe(**fresh(call)))
    assert pipe.transformer._hf_hook.replicas[0] is not copies[0]  # made again from the new weights
    pipemap.reset(pipe)
    torch.testing.assert_close(changed, output(pipe(**fresh(call))), **TOLERANCE.get(mode, EXACT))


# sequence shards exchange through torch.distributed's functional collectives, which the fake CUDA does not wrap
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["guidance", "replicated"])
def test_copies_on_another_gpu_follow_weights_changed_in_place(fake_cuda, mode):
    pipe, call = true_cfg("wan_t2v", steps=2)
    pipemap.dispatch(pipe, with_copy(pipe, mode))
    copies = pipe.transformer._hf_hook.replicas
    assert copies and all(p.device.index == 1 for p in copies[0].parameters())
    pipe(**fresh(call))
    with torch.no_grad():
        for param in pipe.transformer.parameters():
            param.mul_(1.5)  # the home copy's weights, written in place (as a fused LoRA is)
    changed = output(pipe(**fresh(call))).cpu()
    assert pipe.transformer._hf_hook.replicas[0] is not copies[0]
    pipemap.reset(pipe)
    torch.testing.assert_close(changed, output(pipe(**fresh(call))), atol=0, rtol=0)
