"""torch.compile on a placed denoiser: compiled once, its graphs reused at every later call in every mode (the hooks'
bookkeeping runs between graphs, ``hooks._outside_graphs``), outputs as on plain diffusers. A counting backend
(dynamo's graphs, run eagerly) keeps it quick; the count after each of 5 pipeline calls must stay where the first
call left it."""

from __future__ import annotations

import pytest
import torch

import pipemap
from everyday import STRATEGIES, images, placed, plain


class CountingBackend:
    """A dynamo backend that counts the graphs it is given and runs each as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph.forward


def _counts_over_five_calls(pipe, kind: str, backend: CountingBackend) -> tuple[list[int], torch.Tensor]:
    counts = []
    for _ in range(5):
        out = images(pipe, kind)
        counts.append(backend.graphs)
    return counts, out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_repeated_blocks_compile_once_in_every_mode(strategy):
    torch._dynamo.reset()
    pipe, _ = placed("sd", strategy)
    backend = CountingBackend()
    pipe.unet.compile_repeated_blocks(backend=backend)
    counts, out = _counts_over_five_calls(pipe, "sd", backend)
    assert counts[0] > 0 and counts == [counts[0]] * 5  # no graph after the first call
    torch.testing.assert_close(out, images(plain("sd"), "sd"), atol=1e-5, rtol=0)
    pipemap.reset(pipe)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced_low_memory", "parallel"])
def test_a_whole_compiled_denoiser_is_one_graph_compiled_once(strategy):
    # offloaded: the weights the graph reads are new tensors at each onload (a recompile at each call, before the
    # hooks ran outside the graph); replicated: the home copy is compiled, its copies run eagerly
    torch._dynamo.reset()
    pipe, _ = placed("sd", strategy)
    backend = CountingBackend()
    pipe.unet.compile(backend=backend)
    counts, out = _counts_over_five_calls(pipe, "sd", backend)
    assert counts == [1] * 5  # the hooks' pre_forward and post_forward outside it: the unet's forward, whole
    torch.testing.assert_close(out, images(plain("sd"), "sd"), atol=1e-5, rtol=0)
    pipemap.reset(pipe)
