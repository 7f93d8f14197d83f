"""Everyday diffusers around the call under the moving strategies, on the fake CUDA (tests/fakecuda.py) so weights
really move: a call inside ``torch.inference_mode()`` then an ordinary one, and threads that each make their own
``from_pipe`` copy with a scheduler of its own, as diffusers advises for concurrency; each output equal to plain."""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
from diffusers import StableDiffusionPipeline

import pipemap
from everyday import images, plain, two_gpu_plan
from pipemap import tiny

MOVING = ("balanced_low_memory", "balanced_ultra_low_memory")


def _dispatched(strategy: str):
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    pipemap.dispatch(pipe, two_gpu_plan(pipe, strategy))
    return pipe


@pytest.mark.slow
@pytest.mark.parametrize("strategy", MOVING)
def test_an_inference_mode_call_then_an_ordinary_one_both_equal_plain(fake_cuda, strategy):
    # buffers and copies made inside inference_mode are inference tensors: an ordinary call after must not update
    # them in place ("Inplace update to inference tensor outside InferenceMode")
    pipe = _dispatched(strategy)
    want = images(plain("sd"), "sd")
    with torch.inference_mode():
        first = images(pipe, "sd")
    torch.testing.assert_close(first, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-5, rtol=0)
    with torch.inference_mode():  # and back again
        torch.testing.assert_close(images(pipe, "sd"), want, atol=1e-5, rtol=0)
    pipemap.reset(pipe)


def _own_copy_call(pipe, out: dict, index: int) -> None:
    try:
        mine = StableDiffusionPipeline.from_pipe(pipe)
        mine.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        mine.set_progress_bar_config(disable=True)
        out[index] = images(mine, "sd")
    except BaseException as err:  # the thread's failure, reported by the test with its traceback
        out[index] = RuntimeError("".join(traceback.format_exception(err)))


@pytest.mark.slow
def test_three_threads_each_with_its_own_from_pipe_copy_equal_plain(fake_cuda):
    pipe = _dispatched("balanced_low_memory")
    want = images(plain("sd"), "sd")
    for _ in range(3):  # the failure is timing-dependent: a few rounds
        out: dict = {}
        threads = [threading.Thread(target=_own_copy_call, args=(pipe, out, i)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for index in range(3):
            assert not isinstance(out[index], BaseException), str(out[index])
            torch.testing.assert_close(out[index], want, atol=1e-5, rtol=0)
    pipemap.reset(pipe)
