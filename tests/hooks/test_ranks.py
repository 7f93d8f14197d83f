"""What runs a split denoiser's other ranks (``ranks=``: ``modes.RANKS``, ``hooks.ranks``): worker processes by
default, threads where asked for, where the model cannot travel to a worker (with a warning), and on the dry run's
stand-ins; a worker that fails inside a split is the error raised, typed, at once. Each test that starts a worker
(a spawned interpreter importing torch and diffusers) builds the smallest pipeline its mode needs."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import warnings

import psutil
import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import families
import pipemap
from families import fresh, output
from helpers import processes_gone, split_tolerance, with_copy
from pipemap import modes, tiny
from pipemap.errors import CannotTravelError, RanksFallbackWarning, WorkerCallError, WorkerDiedError
from pipemap.hooks.calls import join_batch, split_batch
from pipemap.hooks.copies import CopiesHook
from pipemap.hooks.launch import TIMEOUT_ENV
from pipemap.hooks.resident import PlacementHook
from pipemap.hooks.worker import caller_state, entered, numerics
from pipemap.hooks.workers import ENV
from pipemap.runtime.transfer import move
from worker_faults import RaisingInWorker

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
TOLERANCE = {"atol": 1e-4, "rtol": 0}
STEPS = 2


@pytest.fixture
def unset(monkeypatch):
    """No PIPEMAP_WORKERS: what a user gets (the suite sets it to "thread" for the tests not about ranks)."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(TIMEOUT_ENV, "60")


def _family(name: str):
    """A tiny pipeline and a call that uses both GPUs of a parallel plan (Flux with true CFG: a second call a step
    for a guidance copy, or a sequence split of each)."""
    if name in ("flux", "sdxl"):
        pipe = tiny.build(name)
        pipe.set_progress_bar_config(disable=True)
        call = dict(tiny.default_call(pipe, name, output_type="pt"), num_inference_steps=STEPS,
                    generator=torch.Generator().manual_seed(0))
        return pipe, dict(call, negative_prompt="blurry", true_cfg_scale=2.0) if name == "flux" else call
    return families.true_cfg(name, STEPS)


def _planned(pipe, call: dict, **options):
    """strategy "parallel" for the call's guidance (true CFG: a second denoiser call a step), as a user plans it."""
    guidance = {k: call[k] for k in ("negative_prompt", "true_cfg_scale", "guidance_scale") if k in call}
    return pipemap.plan(pipe, hardware="2x64MiB,cpu=1GiB", strategy="parallel", headroom=0.0, call=guidance, **options)


def _denoiser(pipe) -> str:
    return "unet" if "unet" in pipe.components else "transformer"


def _listening(pids: list[int]) -> list[str]:
    return [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


# ---- a made-up parallel mode, written once over the seam --------------------------------------------------------


class SwappedHook(CopiesHook):
    """A made-up parallel mode: each call's batch cut in two, the FIRST part sent to rank 1 and the last computed
    here, joined in order. Written once, over ``ranks.Ranks`` alone: whatever runs the ranks."""

    takes_forward = False

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = PlacementHook.pre_forward(self, module, *args, **kwargs)
        first, last = split_batch(args, kwargs, 2)
        self.sent = self.live_ranks().submit([first])
        return last

    def post_forward(self, module, output):
        (theirs,) = self.sent.result()
        return PlacementHook.post_forward(self, module, join_batch([move(theirs, self.device), output]))


SWAPPED = modes.ModeFacts(**{**modes.facts("replicated").__dict__, "mode": "swapped", "hook": (__name__, "SwappedHook"),
                             "text": lambda p: f"swapped: first part on {p.replicas[0]}"})


@pytest.fixture
def swapped():
    modes.register(SWAPPED)
    yield SWAPPED.mode
    modes.unregister(SWAPPED.mode)


def _swapped_plan(pipe, mode: str):
    plan = pipemap.plan(pipe, hardware="2x8MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    assert plan.placement("unet").mode == "replicated"
    return plan.with_components(tuple(p if p.component != "unet" else p.__class__(**{**p.__dict__, "mode": mode})
                                      for p in plan.components))


@pytest.mark.parametrize("ranks", ["dry-run", "thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_made_up_parallel_mode_runs_on_threads_processes_and_in_the_dry_run_equal_to_plain(unset, swapped, ranks):
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "sd", output_type="pt"), num_inference_steps=STEPS)
    plain = output(pipe(**fresh(call)))
    plan = _swapped_plan(pipe, swapped)
    if ranks == "dry-run":  # the stand-ins: the same hook over in-process ranks, rank 1's part on meta:1
        report = pipemap.simulate(pipe, plan)
        assert report.ok, report.error
        used = {d.device: d.used for d in plan.devices}
        assert report.weight_bytes["cuda:1"] == pytest.approx(used["cuda:1"], rel=0.01)  # the copy landed there
        assert report.activation_bytes["cuda:1"] > 0  # rank 1 computed its part of the batch there
        return
    pipemap.dispatch(pipe, plan.remap(ON_CPU), ranks=ranks)
    hook = pipe.unet._hf_hook
    assert type(hook) is SwappedHook and hook.runtime == ranks
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    pids = hook.pids()
    assert (len(pids) == 1 and pids[0] in hook.ranks.served) if ranks == "process" else hook.replicas
    pipemap.reset(pipe)
    assert processes_gone(pids)


# Wan's planned parallel plan on a worker: tests/hooks/test_guidance.py (its worker section); guidance_sequence's
# three workers: tests/hooks/test_guidance_sequence.py (both as a user runs them, with no setting but the timeout's)
@pytest.mark.parametrize("name", [pytest.param("flux", marks=pytest.mark.slow), "qwen_image", "sdxl"])
def test_a_parallel_plan_remapped_runs_its_ranks_in_worker_processes_with_no_setting_and_equals_plain(unset, name):
    pipe, call = _family(name)
    plain = output(pipe(**fresh(call)))
    plan = _planned(pipe, call)
    denoiser = _denoiser(pipe)
    assert plan.placement(denoiser).replicas == ("cuda:1",)
    assert (plan.ranks, plan.ranks_asked) == ("process", False)  # ranks="auto" with nothing set: processes
    assert f"ranks: {denoiser!r} on cuda:0, cuda:1: process: a worker process per GPU" in plan.explain()
    assert pipemap.Plan.from_json(plan.to_json()) == plan and plan.remap(ON_CPU).ranks == "process"
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = getattr(pipe, denoiser)._hf_hook
    (pid,) = hook.pids()
    assert pid != os.getpid()
    # the workers listen on loopback only (a plan for one machine): their store, gloo's pairs
    assert [a for a in _listening([os.getpid(), pid]) if not a.startswith("127.")] == []
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    assert pid in hook.ranks.served  # the second process computed
    report = pipemap.stats(pipe)[denoiser]
    assert report["ranks"] == "process" and report["ranks_why"].startswith("ranks='auto'")
    pipemap.reset(pipe)
    assert processes_gone([pid])


def test_a_sequence_split_runs_its_other_rank_in_a_worker_process_with_no_setting_and_equals_plain(unset):
    pipe, call = _family("flux")
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))  # a plan made by hand: ranks="auto" then
    hook = pipe.transformer._hf_hook
    (pid,) = hook.pids()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    assert hook.ranks.served == [pid] * (2 * STEPS) and hook.whole == 0  # its share of every call
    pipemap.reset(pipe)
    assert processes_gone([pid])


def test_guidance_x_sequence_runs_its_three_other_ranks_in_worker_processes_with_no_setting_and_equals_plain(unset):
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    plain = output(pipe(**fresh(call)))
    plan = with_copy(pipe, "guidance_sequence", hardware="4x64MiB,cpu=1GiB", copies=3)
    pipemap.dispatch(pipe, plan.remap({f"cuda:{i}": "cpu" for i in range(4)}))
    hook = pipe.transformer._hf_hook
    pids = hook.pids()
    assert hook.runtime == "process" and len(pids) == 3 and hook.replicas == []  # no rank's copy in this process
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **split_tolerance(operation="attention"))
    assert set(hook.ranks.served) <= set(pids) and hook.hits == STEPS - 1 and hook.whole == 0
    pipemap.reset(pipe)
    assert processes_gone(pids)


@pytest.mark.parametrize("asked", ["thread", "process"])
def test_threads_when_asked_by_name_and_a_changed_ranks_at_dispatch(unset, asked):
    pipe, call = _family("qwen_image")
    plain = output(pipe(**fresh(call)))
    plan = _planned(pipe, call, ranks=asked)
    assert (plan.ranks, plan.ranks_asked) == (asked, True) and "(asked for by name)" in plan.explain()
    pipemap.dispatch(pipe, plan.remap(ON_CPU), ranks="thread")  # dispatch's word wins over the plan's
    hook = pipe.transformer._hf_hook
    assert pipemap.stats(pipe)["transformer"]["ranks"] == hook.runtime == "thread" and hook.replicas  # copies here
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    pipemap.reset(pipe)
    with pytest.raises(pipemap.WorkersOptionError, match="ranks='threads' is not understood"):
        pipemap.plan(pipe, hardware="2x64MiB,cpu=1GiB", strategy="parallel", ranks="threads")


class _ScriptProcessor(FluxAttnProcessor):
    """A processor class as a user's script defines it: in ``__main__``, which a spawned worker does not run."""


_ScriptProcessor.__module__ = "__main__"


@pytest.mark.parametrize("change", ["script-class", "layerwise-casting"])
def test_a_model_that_cannot_travel_falls_back_to_threads_under_auto_and_is_refused_when_processes_are_asked(
        unset, change):
    pipe, call = _family("flux")
    if change == "script-class":
        pipe.transformer.set_attn_processor(_ScriptProcessor())
        named = "_ScriptProcessor is defined in the script's __main__"
    else:  # diffusers' fp8-storage recipe: a hook whose forward is a local function, which pickle cannot take
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        named = "Can't pickle local object"
    plain = output(pipe(**fresh(call)))
    plan = with_copy(pipe, "guidance").remap(ON_CPU)
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(CannotTravelError, match=named) as caught:  # said before any worker starts
        pipemap.dispatch(pipe, plan, ranks="process")
    assert caught.value.component == "transformer" and not hasattr(pipe.transformer, "_hf_hook")
    assert set(psutil.Process().children(recursive=True)) == before
    with pytest.warns(RanksFallbackWarning, match=named):
        pipemap.dispatch(pipe, plan, ranks="auto")
    report = pipemap.stats(pipe)["transformer"]
    assert report["ranks"] == "thread" and named in report["ranks_why"]
    if change == "script-class":  # (on this remap the thread copy shares the home's weights, which layerwise
        # casting re-casts in place around each call: a race of the CPU remap only, where copies share tensors)
        torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    pipemap.reset(pipe)


def test_a_worker_s_call_runs_under_the_caller_s_process_wide_numerics():
    from diffusers.models.attention_dispatch import attention_backend

    own = numerics()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        with attention_backend("_native_math"), torch.no_grad():
            state = caller_state()  # what a worker is sent with each call
    finally:
        torch.set_float32_matmul_precision(before)
    assert state[3]["precision"] == "medium" and state[3]["attention"] == "_native_math"
    with entered(state, torch.device("cpu")):  # what the worker runs the call under
        assert numerics() == state[3] and not torch.is_grad_enabled()
    assert numerics() == own  # the worker's own back after the call


@pytest.fixture
def raising(monkeypatch):
    """A flag file: while it exists, the worker ranks' attention raises an out-of-memory error."""
    flag = os.path.join(tempfile.mkdtemp(), "raise")
    monkeypatch.setenv("PIPEMAP_TEST_RAISE", flag)  # before the workers start: they inherit it
    monkeypatch.setenv("PIPEMAP_TEST_CALLER", str(os.getpid()))
    return flag


@pytest.mark.slow
def test_a_worker_failing_inside_a_sequence_split_is_raised_at_once_typed_and_the_next_call_works(unset, raising):
    pipe, call = _family("flux")
    pipe.transformer.set_attn_processor(RaisingInWorker())
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU), ranks="process")
    hook = pipe.transformer._hf_hook
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    open(raising, "w").close()
    start = time.monotonic()
    with pytest.raises(torch.OutOfMemoryError, match=r"worker process \(pid \d+\) running 'transformer' on cpu"):
        pipe(**fresh(call))  # the worker's own error, not gloo's timeout, while rank 0 waited in the exchange
    assert time.monotonic() - start < 10
    os.remove(raising)
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)  # new workers
    (pid,) = hook.pids()
    seen = []

    def kill_mid(module, args, kwargs):  # the second transformer call: the worker dies inside the split
        seen.append(1)
        if len(seen) == 2:
            os.kill(pid, signal.SIGKILL)

    handle = pipe.transformer.register_forward_pre_hook(kill_mid, with_kwargs=True)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as died:
        pipe(**fresh(call))
    handle.remove()
    assert time.monotonic() - start < 10 and died.value.pid == pid and died.value.phase == "call"
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    pids = hook.pids()
    pipemap.reset(pipe)
    assert processes_gone(pids + [pid])


@pytest.mark.slow
def test_two_calls_out_at_once_keep_their_outputs_and_a_worker_s_error_carries_its_traceback(unset):
    from pipemap.hooks.worker import Source
    from pipemap.hooks.workers import Workers

    module = torch.nn.Linear(3, 2)
    cpu = torch.device("cpu")
    workers = Workers("m", cpu, (cpu,))
    try:
        workers.sync(module, Source.of(module))
        x = torch.randn(4, 3)
        with torch.no_grad():  # two calls out at once: the later received first keeps the earlier's outputs (WP15)
            first = workers.send([((x,), {})], caller_state())
            second = workers.send([((2 * x,), {})], caller_state())
            (late,) = workers.receive(second)
            (early,) = workers.receive(first)
        torch.testing.assert_close(early, module(x), atol=0, rtol=0)
        torch.testing.assert_close(late, module(2 * x), atol=0, rtol=0)
        assert workers.peaks() == {"cpu": 0}  # no CUDA allocator on the CPU
        with pytest.raises(WorkerCallError, match="mat1 and mat2"):
            workers.receive(workers.send([((torch.randn(4, 5),), {})], caller_state()))
    finally:
        workers.close()


@pytest.mark.slow
def test_a_dispatch_that_fails_after_its_workers_started_leaves_no_worker(unset, monkeypatch):
    pipe, _call = _family("flux")
    plan = with_copy(pipe, "guidance").remap(ON_CPU)
    from pipemap.hooks import workers as module

    started: list[int] = []
    real_sync = module.Workers.sync

    def sync_then_fail(self, plain, source):  # the workers start, then the copy cannot be brought in line
        real_sync(self, plain, source)
        started.extend(self.pids())
        raise RuntimeError("the copy could not be synced")

    monkeypatch.setattr(module.Workers, "sync", sync_then_fail)
    with warnings.catch_warnings(), pytest.raises(pipemap.DispatchError, match="could not be synced"):
        pipemap.dispatch(pipe, plan, ranks="process")
    assert started and processes_gone(started)
    assert not hasattr(pipe.transformer, "_hf_hook")
