"""parallel: overlapped requests (run_many), calls from several threads, run_many over denoiser replicas."""

from __future__ import annotations

import threading

import pytest
import torch

import pipemap
from pipemap import tiny
from pipemap.dispatch.parallel import current_request

TWO_GPUS = "cuda:0=5MiB,cuda:1=5MiB,cpu=1GiB"  # tiny sd: unet 3.0 MiB; vae 2.5 + text encoder 0.2
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


@pytest.fixture(scope="module")
def staged():
    """The tiny SD pipeline planned for two GPUs (text encoder and VAE on one, the unet on the other), on the CPU."""
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0)
    assert plan.device_map["unet"] != plan.device_map["text_encoder"] == plan.device_map["vae"]
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    yield pipe
    pipemap.reset(pipe)


def _calls(n: int) -> list[dict]:
    return [dict(prompt=f"a tiny cat number {i}", num_inference_steps=2 + i % 2, guidance_scale=(5.0, 7.5, 1.0)[i % 3],
                 generator=torch.Generator().manual_seed(i), output_type="np") for i in range(n)]


def _images(outputs) -> list[torch.Tensor]:
    return [torch.as_tensor(o.images) for o in outputs]


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_run_many_equals_one_by_one(staged):
    one_by_one = _images(staged(**call) for call in _calls(4))
    for got, want in zip(_images(pipemap.run_many(staged, _calls(4), workers=2)), one_by_one, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    lazily = pipemap.iter_many(staged, iter(_calls(3)), workers=3)  # an iterator in, a generator out
    for got, want in zip(_images(lazily), one_by_one[:3], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    """A submodule that runs inside the component's call, hence inside the lock its hook holds."""
    return next(m for m in module.modules() if m is not module and not list(m.children()))


def test_run_many_overlaps_stages_of_different_requests(staged):
    """Request 1's text encoder starts only once request 0's unet runs, and request 0's unet call (its lock held)
    waits for it: the run finishes with both waits met only if one request's text encoder runs while another's
    denoiser works. No timing: were requests run one after another, request 0 would wait in vain."""
    log, met = [], []
    denoising, encoded = threading.Event(), threading.Event()

    def gate(module, args):  # outside the text encoder's lock, so request 0 can still encode
        if current_request() == 1:
            denoising.wait(timeout=60)

    def record(component):
        def hook(module, args):
            log.append((current_request(), component))
            if component == "text_encoder" and current_request() == 1:
                encoded.set()
            if component == "unet" and current_request() == 0 and not met:
                denoising.set()
                met.append(encoded.wait(timeout=60))
        return hook

    handles = [staged.text_encoder.register_forward_pre_hook(gate)]
    handles += [_inner(getattr(staged, name)).register_forward_pre_hook(record(name))
                for name in ("text_encoder", "unet", "vae")]
    try:
        outputs = pipemap.run_many(staged, _calls(3), workers=2)
    finally:
        for handle in handles:
            handle.remove()
    assert met == [True]
    first_unet, last_unet = (log.index((0, "unet")), len(log) - 1 - log[::-1].index((0, "unet")))
    assert (1, "text_encoder") in log[first_unet:last_unet]  # interleaved, not one request after another
    assert [o.images.shape for o in outputs] == [(1, 32, 32, 3)] * 3


@pytest.mark.slow  # over 1 s on 2 cores: out of the quick subset
def test_threads_calling_a_mapped_pipeline_take_turns(staged):
    """A second thread's call waits for the first to finish, so neither sees the other's scheduler state."""
    calls = _calls(2)
    want = _images(staged(**call) for call in _calls(2))
    got, entered = {}, threading.Event()
    second = threading.Thread(target=lambda: got.setdefault(1, staged(**calls[1])))
    te_hook = _inner(staged.text_encoder).register_forward_pre_hook(
        lambda m, a: entered.set() if threading.current_thread() is second else None)
    started = []

    def unet_hook(module, args):
        if threading.current_thread() is threading.main_thread() and not started:
            second.start()
            started.append(entered.wait(timeout=1.0))  # would be True at once if the second call ran beside ours

    handle = _inner(staged.unet).register_forward_pre_hook(unet_hook)
    try:
        got[0] = staged(**calls[0])
        second.join()
    finally:
        handle.remove()
        te_hook.remove()
    assert started == [False]
    for i in range(2):
        torch.testing.assert_close(torch.as_tensor(got[i].images), want[i], atol=0, rtol=0)


def test_mapped_class_keeps_its_name_and_reset_gives_it_back():
    pipe = tiny.build("sd")
    cls = type(pipe)
    pipemap.dispatch(pipe, pipemap.plan(pipe, hardware="cpu=1GiB"))
    assert isinstance(pipe, cls) and type(pipe).__name__ == cls.__name__ and type(pipe).__module__ == cls.__module__
    pipemap.reset(pipe)
    assert type(pipe) is cls and "_pipemap" not in pipe.__dict__  # its record, with the call lock, gone too


def test_run_many_errors(staged):
    with pytest.raises(pipemap.RunManyCallError) as err:
        pipemap.run_many(staged, [{"prompt": "a"}], workers=0)
    assert err.value.argument == "workers" and isinstance(err.value, ValueError)
    with pytest.raises(pipemap.RunManyCallError):
        pipemap.iter_many(staged, [], workers=0)  # checked at the call, not at the first result
    with pytest.raises(pipemap.RunManyCallError) as err:
        pipemap.run_many(staged, ["a cat"])
    assert err.value.argument == "calls[0]" and err.value.value == "a cat"
    bad = dict(_calls(1)[0], prompt=None)  # neither a prompt nor embeddings: the pipeline refuses
    results = pipemap.run_many(staged, [bad, _calls(1)[0]], return_exceptions=True)
    assert isinstance(results[0], ValueError) and results[1].images.shape == (1, 32, 32, 3)
    with pytest.raises(ValueError):
        pipemap.run_many(staged, [bad])


def test_run_many_refuses_hooks_it_cannot_lock():
    from accelerate.hooks import CpuOffload, add_hook_to_module

    pipe = tiny.build("sd")
    add_hook_to_module(pipe.unet, CpuOffload(execution_device="cpu"))
    with pytest.raises(pipemap.ForeignHookError) as err:
        pipemap.run_many(pipe, [{"prompt": "a"}])
    assert err.value.component == "unet" and err.value.hook == "CpuOffload"


# ---- run_many over denoiser replicas ------------------------------------------------------------------------------

# tiny sd: unet 3.0 MiB, vae 2.5, text encoder 0.2. At 8 MiB a GPU holds a copy of the unet and the vae.
PARALLEL_GPUS = {2: "2x8MiB,cpu=1GiB"}


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_loaded_onto_a_parallel_plan_and_run_many_over_replicas(tiny_folders, reference_outputs):
    from helpers import run

    plan = pipemap.plan(tiny_folders["sd"], hardware=PARALLEL_GPUS[2], strategy="parallel", headroom=0.0)
    pipe = pipemap.load(tiny_folders["sd"], plan=plan.remap(ON_CPU), progress=False)
    assert len(pipe.unet._hf_hook.replicas) == 1
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    one_by_one = _images(pipe(**call) for call in _calls(3))
    for got, want in zip(_images(pipemap.run_many(pipe, _calls(3), workers=2)), one_by_one, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["guidance", "replicated"])
def test_run_many_keeps_the_copies_of_an_unchanged_model_across_batches(mode):
    import families
    from families import fresh
    from helpers import with_copy

    pipe, call = families.true_cfg("wan_t2v", 2)
    pipemap.dispatch(pipe, with_copy(pipe, mode).remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    # what a forward may leave on the model (diffusers' hook registry, made by the first ``cache_context``; a plain
    # attribute): no change of the model, so no new copies
    pipe.transformer.register_forward_pre_hook(lambda m, args: m.__dict__.__setitem__("seen_call", True))
    copies = set()
    for _ in range(3):
        pipemap.run_many(pipe, [fresh(call), fresh(call)], workers=2)
        copies.add(id(pipe.transformer._hf_hook.replicas[0]))
    assert len(copies) == 1
    pipemap.reset(pipe)


@pytest.mark.slow
def test_iter_many_over_a_blocking_queue_answers_each_request_before_the_next_is_sent(staged):
    # a client that waits for its answer before sending its next request (issue 39: the answer came only once
    # 2 * workers + 1 requests were in); the source is read on a thread of its own, so each answer comes when done
    import queue

    requests: queue.Queue = queue.Queue()
    answers = pipemap.iter_many(staged, iter(requests.get, None), workers=2)
    want = _images(staged(**call) for call in _calls(2))
    for call, expected in zip(_calls(2), want, strict=True):
        requests.put(call)
        torch.testing.assert_close(_images([next(answers)])[0], expected, atol=0, rtol=0)
    requests.put(None)
    assert next(answers, None) is None


def test_iter_many_raises_a_bad_call_in_its_turn_and_stops_reading_when_closed(staged):
    read = []

    def calls():
        for i, call in enumerate(_calls(3)):
            read.append(i)
            yield call if i != 1 else "a cat"

    answers = pipemap.iter_many(staged, calls(), workers=1)
    assert next(answers).images.shape == (1, 32, 32, 3)  # the good one before it first
    with pytest.raises(pipemap.RunManyCallError) as err:
        next(answers)
    assert err.value.argument == "calls[1]"
    answers.close()
    assert read == [0, 1]


def test_iter_unordered_answers_a_short_call_before_a_long_one_sent_first(staged):
    # call 0 waits at its first step's end until call 1's answer is out: in submission order it would wait in vain
    from pipemap.dispatch.parallel import iter_unordered

    calls = _calls(2)
    want = _images(staged(**call) for call in _calls(2))
    answered = threading.Event()

    def hold(pipe, step, timestep, tensors):
        assert answered.wait(60), "the short call's answer waited for the long one"
        return {}

    answers = iter_unordered(staged, [{**calls[0], "callback_on_step_end": hold}, calls[1]], workers=2)
    index, first = next(answers)
    answered.set()
    rest = list(answers)
    assert index == 1 and [i for i, _ in rest] == [0]
    for got, expected in zip(_images([rest[0][1], first]), want, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_iter_unordered_puts_a_failed_calls_error_in_its_place_or_raises_it(staged):
    from pipemap.dispatch.parallel import iter_unordered

    bad = {"prompt": None, "num_inference_steps": 1, "output_type": "np"}  # neither prompt nor embeddings
    outcomes = dict(iter_unordered(staged, [bad, _calls(1)[0]], workers=2, return_exceptions=True))
    assert isinstance(outcomes[0], ValueError) and outcomes[1].images.shape == (1, 32, 32, 3)
    with pytest.raises(ValueError):
        list(iter_unordered(staged, [bad], workers=1))
    with pytest.raises(pipemap.RunManyCallError):
        iter_unordered(staged, [], workers=0)
