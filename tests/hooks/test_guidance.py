"""Guidance branches at once (``hooks/guidance.py``, mode ``"guidance"``): each step's second denoiser call started
ahead on a copy on another GPU, used only when the call that arrives has exactly its inputs. On two stand-in GPUs
(the dry run), remapped onto the CPU (outputs equal the plain pipeline's), with a miss, and by hand.

On worker processes (the tests below the line): the second branch of each step started ahead on a worker process,
remapped onto the CPU; outputs equal the plain pipeline's."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import families
import pipemap
from families import fresh, output
from helpers import pipeline_state, processes_gone, with_copy
from pipemap import tiny
from pipemap.hooks import GuidanceHook, hook_component, unhook_component
from pipemap.hooks.guidance import Inputs, alike, predict, same
from pipemap.hooks.workers import ENV
from pipemap.plan import DeviceUse, Placement, Plan

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
STEPS = 3


def true_cfg(name: str):
    return families.true_cfg(name, STEPS)


# ---- on two stand-in GPUs ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan_t2v", "qwen_image"])
def test_the_dry_run_computes_the_second_branch_on_the_second_stand_in_within_budget(name):
    pipe, call = true_cfg(name)
    plan = with_copy(pipe, "guidance")
    extra = {k: v for k, v in call.items() if k not in ("prompt", "generator", "output_type", "num_inference_steps")}
    report = pipemap.simulate(pipe, plan, steps=STEPS, **extra)
    assert report.ok, report.error
    copy = plan.placement("transformer").bytes
    assert report.weight_bytes["cuda:1"] >= copy  # the copy landed there (with its buffers)
    assert report.activation_bytes["cuda:1"] > 0 and report.peak_phase["cuda:1"].startswith("denoising")
    for device in plan.devices:
        assert report.peak_bytes[device.device] <= device.budget


# ---- remapped onto the CPU: the plain pipeline's outputs --------------------------------------------------------


@pytest.mark.parametrize("name", ["wan_t2v", "qwen_image"])
def test_on_the_cpu_each_step_after_the_first_takes_the_copy_s_result_and_equals_plain(name):
    pipe, call = true_cfg(name)
    plain = output(pipe(**fresh(call)))
    before = pipeline_state(pipe)
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceHook) and len(hook.replicas) == 1
    threads: list[str] = []
    handle = hook.replicas[0].register_forward_pre_hook(lambda m, a: threads.append(threading.current_thread().name))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert (hook.hits, hook.misses) == (STEPS - 1, 0)  # the first step has no step before it to predict from
    assert len(threads) == STEPS - 1 and all(t.startswith("pipemap-transformer") for t in threads)
    handle.remove()
    pipemap.reset(pipe)
    assert pipeline_state(pipe) == before


def _replacing_negative_embeddings(pipe, step, timestep, tensors):
    return {"negative_prompt_embeds": tensors["negative_prompt_embeds"] * 0.5}  # a new tensor each step


def _halving_negative_embeddings_in_place(pipe, step, timestep, tensors):
    return {"negative_prompt_embeds": tensors["negative_prompt_embeds"].mul_(0.5)}  # the same tensor, changed


def test_strategy_parallel_plans_guidance_branches_for_wan_and_its_plan_runs_as_plain():
    pipe, call = true_cfg("wan_t2v")
    plain = output(pipe(**fresh(call)))
    plan = pipemap.plan(pipe, hardware="2x64MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    transformer = plan.placement("transformer")
    assert (transformer.mode, transformer.replicas) == ("guidance", ("cuda:1",))
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert pipe.transformer._hf_hook.hits == STEPS - 1


def test_under_inference_mode_the_copy_s_result_is_still_used_and_equals_plain():
    pipe, call = true_cfg("wan_t2v")
    with torch.inference_mode():
        plain = output(pipe(**fresh(call)))
        pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
        torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert (pipe.transformer._hf_hook.hits, pipe.transformer._hf_hook.misses) == (STEPS - 1, 0)


@pytest.mark.parametrize(("callback", "hits"), [
    (_replacing_negative_embeddings, 0),  # each second call brings other embeddings than the step before: a miss
    (_halving_negative_embeddings_in_place, STEPS - 1),  # the copy reads them after the change: a hit, still exact
])
def test_inputs_changed_between_steps_miss_or_hit_and_always_equal_plain(callback, hits):
    pipe, call = true_cfg("wan_t2v")
    call = dict(call, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["negative_prompt_embeds"])
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert (hook.hits, hook.misses) == (hits, STEPS - 1 - hits)


def test_requests_overlapped_by_run_many_keep_their_own_branches():
    pipe, call = true_cfg("wan_t2v")
    calls = [dict(fresh(call), prompt=p) for p in ("a tiny cat", "a tiny dog", "a tiny bird")]
    plain = [output(pipe(**dict(c, generator=torch.Generator().manual_seed(0)))) for c in calls]
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    results = pipemap.run_many(pipe, [dict(c, generator=torch.Generator().manual_seed(0)) for c in calls], workers=2)
    for got, want in zip(results, plain, strict=True):
        torch.testing.assert_close(output(got), want, atol=0, rtol=0)
    assert pipe.transformer._hf_hook.hits > 0


@pytest.mark.parametrize("name", ["wan_i2v", "flux_kontext", "lumina2"])
def test_more_families_with_true_guidance_equal_plain(name):
    pipe, call = true_cfg(name)
    if name == "flux_kontext":
        call = dict(call, negative_prompt="blurry", true_cfg_scale=3.0)
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert pipe.transformer._hf_hook.hits == STEPS - 1


def test_a_copy_beside_its_model_holds_its_own_weights_under_layerwise_casting():
    """Layerwise casting casts the weights in place around each call: a thread rank on the model's own device (a plan
    remapped onto the CPU) sharing them read them half cast about one call in five
    (bench/repros/workers/thread_guidance_layerwise_race.py); it gets its own."""
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=STEPS,
                negative_prompt="blurry", true_cfg_scale=2.0)
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU), ranks="thread")
    hook = pipe.transformer._hf_hook
    home = {p.data_ptr() for p in pipe.transformer.parameters()}
    assert not home & {p.data_ptr() for p in hook.replicas[0].parameters()}
    for _ in range(3):  # one call in five failed when the copy shared them
        torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert hook.hits > 0  # the copy computed
    pipemap.reset(pipe)


# ---- by hand: predicting the next call, checking the one that arrives --------------------------------------------


def _inputs(*args, **kwargs) -> Inputs:
    return Inputs.of(args, kwargs)


def test_the_next_call_takes_the_second_branch_s_inputs_where_the_branches_differed():
    latents, later, t, t2 = torch.ones(2), torch.zeros(2), torch.tensor(1.0), torch.tensor(2.0)
    cond, uncond = torch.full((3,), 5.0), torch.full((3,), -5.0)
    first, second = _inputs(latents, t, context=cond), _inputs(latents, t, context=uncond)
    upcoming = predict((first, second), _inputs(later, t2, context=cond))
    assert upcoming is not None and upcoming.leaves[0] is later and upcoming.leaves[1] is t2
    assert upcoming.leaves[2] is uncond
    assert predict((second, first), _inputs(later, t2, context=cond)) is None  # a second branch: nothing to start
    assert predict((first,), _inputs(later, t2, context=cond)) is None  # one call seen: no pattern yet
    assert predict((first, second), _inputs(later, t2, context=cond, scale=2.0)) is None  # another call shape


def test_an_arriving_input_is_the_same_when_one_unchanged_tensor_or_equal_values():
    x = torch.arange(4.0)
    read = _inputs(x, 3, "a")
    seen = Inputs.started(read.spec, read.leaves)
    assert all(same(seen, _inputs(x, 3, "a"), i) for i in range(3))
    assert same(seen, _inputs(x.clone(), 3, "a"), 0)  # equal values in another tensor
    assert not same(seen, _inputs(x + 1, 3, "a"), 0) and not same(seen, _inputs(x, 4, "a"), 1)
    assert not same(seen, _inputs(x.double(), 3, "a"), 0)
    x.add_(1)  # changed in place since it was read: its version counter moved on
    assert not same(seen, _inputs(x, 3, "a"), 0)
    assert alike(x, x) and alike(3, 3) and not alike(3, 3.5) and not alike(x, 3)


def test_without_a_version_counter_the_call_started_ahead_reads_a_copy():
    with torch.inference_mode():
        frozen = torch.ones(2)
        started = Inputs.started(_inputs(frozen).spec, (frozen,))
        assert started.leaves[0] is not frozen and started.versions == (None,)
        assert same(started, _inputs(frozen), 0)
        frozen.add_(1)  # no counter moves: the copy's values tell
        assert not same(started, _inputs(frozen), 0)


class Doubler(torch.nn.Module):
    def forward(self, x, context):
        return x * 2 + context


def test_the_hook_by_hand_hits_misses_and_always_returns_the_plain_result():
    module = Doubler()
    hook = GuidanceHook.for_placement(Placement("m", "cpu", 0, "guidance", replicas=("cpu",)), "cpu", None)
    hook_component(module, hook)
    cond, uncond, other = torch.ones(2), -torch.ones(2), torch.full((2,), 7.0)
    x = [torch.full((2,), float(i)) for i in range(4)]
    calls = [(x[0], cond), (x[0], uncond), (x[1], cond), (x[1], uncond), (x[2], cond), (x[2], other), (x[3], cond),
             (x[3], uncond)]
    with torch.no_grad():
        for latents, context in calls:
            torch.testing.assert_close(module(latents, context=context), latents * 2 + context, atol=0, rtol=0)
    assert (hook.hits, hook.misses) == (1, 2)  # step 2 hits; step 3 brings another context: a miss; step 4
    # started the context of step 3's second call, which step 4's second call does not bring: a miss
    unhook_component(module)
    assert hook.replicas == [] and not hasattr(module, "_hf_hook") and "forward" not in module.__dict__


def test_a_plan_of_guidance_mode_round_trips_and_places_the_copy():
    plan = Plan("parallel", (Placement("transformer", "cuda:0", 10, "guidance", replicas=("cuda:1",)),),
                (DeviceUse("cuda:0", 100, 100, 10), DeviceUse("cuda:1", 100, 100, 10)), "cuda:0")
    assert Plan.from_json(plan.to_json()) == plan
    assert repr(GuidanceHook.for_placement(plan.components[0], "cuda:0", None)) == (
        "GuidanceHook('transformer', device=cuda:0, replicas=[cuda:1], ranks=thread)")


# ---- the model changed inside a call, or a cache on: the copy's result is not used ------------------------------


class _Halved:
    """An attention processor that halves the one it wraps (an attention-control processor a callback swaps in)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, attn, hidden_states, *args, **kwargs):
        return self.inner(attn, hidden_states, *args, **kwargs) * 0.5


def _swapping_processors(pipe, step, timestep, tensors):
    if step == 0:
        for module in pipe.transformer.modules():
            if hasattr(module, "processor") and not isinstance(module.processor, _Halved):
                module.processor = _Halved(module.processor)
    return {}


def _unswapped(pipe) -> None:
    for module in pipe.transformer.modules():
        if isinstance(getattr(module, "processor", None), _Halved):
            module.processor = module.processor.inner


def test_processors_swapped_by_a_step_callback_turn_the_copy_off_and_equal_plain():
    pipe, call = true_cfg("wan_t2v")
    call = dict(call, callback_on_step_end=_swapping_processors)
    plain = output(pipe(**fresh(call)))
    _unswapped(pipe)
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert hook.hits == 0 and not hook.copy_is_current()


def test_a_diffusers_cache_on_the_denoiser_turns_the_copy_off_and_equals_plain():
    from diffusers.hooks import FirstBlockCacheConfig

    pipe, call = families.true_cfg("wan_t2v", 6)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=0, rtol=0)
    assert pipe.transformer._hf_hook.hits == 0


def test_a_pipeline_dispatched_before_its_first_call_still_takes_the_copy_s_results():
    # the pipeline's first ``cache_context`` makes diffusers' hook registry on the denoiser: no change of the model
    pipe, call = true_cfg("wan_t2v")
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    pipe(**fresh(call))
    assert "_diffusers_hook" in pipe.transformer.__dict__ and pipe.transformer._hf_hook.copy_is_current()
    assert pipe.transformer._hf_hook.hits == STEPS - 1


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((2,), 2.0))

    def forward(self, x, context):
        return x * self.weight + context


def test_weights_changed_in_place_between_steps_are_never_answered_from_the_copy():
    module = Scaled()
    hook = GuidanceHook.for_placement(Placement("m", "cpu", 0, "guidance", replicas=("cpu",)), "cpu", None)
    hook_component(module, hook)
    cond, uncond = torch.ones(2), -torch.ones(2)
    with torch.no_grad():
        for step in range(4):
            if step == 2:
                module.weight.mul_(0.5)  # what a step callback (fuse_lora, a weight edit) does
            x = torch.full((2,), float(step))
            for context in (cond, uncond):
                torch.testing.assert_close(module(x, context=context), x * module.weight + context, atol=0, rtol=0)
    assert hook.hits == 1 and not hook.copy_is_current()  # step 1 hit; from step 2 on the copy is stale
    unhook_component(module)


def test_the_branches_embeddings_are_compared_once_a_call_not_once_a_step(monkeypatch):
    # a comparison of values makes the host wait for the GPU: the prompt's and the negative prompt's embeddings,
    # unchanged from step to step, are compared once
    from pipemap.hooks import guidance

    compared = []
    equal = guidance._equal_tensors
    monkeypatch.setattr(guidance, "_equal_tensors", lambda x, y: compared.append(1) or equal(x, y))
    pipe, call = families.true_cfg("wan_t2v", 5)
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    pipe(**fresh(call))
    assert pipe.transformer._hf_hook.hits == 4 and len(compared) == 1


def test_a_kept_comparison_is_made_again_once_either_tensor_changed():
    cond, uncond, latents = torch.ones(3), -torch.ones(3), torch.zeros(2)
    first, second = _inputs(latents, context=cond), _inputs(latents, context=uncond)
    kept: dict = {}
    upcoming = predict((first, second), _inputs(latents + 1, context=cond), kept)
    assert upcoming is not None and upcoming.leaves[1] is uncond and len(kept) == 1
    uncond.copy_(cond)  # now equal: the branches no longer differ there
    assert predict((first, second), _inputs(latents + 1, context=cond), kept).leaves[1] is cond


# ---- on worker processes
@pytest.mark.slow
def test_qwen_image_s_second_branch_runs_on_a_worker_equals_plain_and_a_dead_worker_costs_only_a_miss(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # as a user runs it: ranks="auto", worker processes
    pipe, call = families.true_cfg("qwen_image", STEPS)
    plain = output(pipe(**fresh(call)))
    plan = with_copy(pipe, "guidance")
    dry = pipemap.simulate(pipe, plan, steps=2, advice=False,
                           **{k: v for k, v in fresh(call).items() if k not in ("generator", "num_inference_steps")})
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceHook) and hook.runtime == "process"
    assert hook.replicas == [] and hook.ranks is not None
    # what the worker holds on its device is what the dry run's stand-in for cuda:1 held, and the plan's figure
    assert hook.ranks.held() == [dry.weights_held("cuda:1")] == [plan.placement("transformer").bytes]
    (pid,) = hook.pids()
    assert pid != os.getpid()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)
    assert (hook.hits, hook.misses) == (STEPS - 1, 0)  # the first step has no step before it to predict from
    assert hook.ranks.served == [pid] * (STEPS - 1)  # each later step's second branch computed by the worker

    def kill_once(module, args):  # a step's first branch runs here while its second was sent: kill the worker
        if hook.hits + hook.misses == 1:
            handle.remove()
            os.kill(pid, signal.SIGKILL)

    handle = pipe.transformer.register_forward_pre_hook(kill_once)
    hook.hits = hook.misses = 0
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)  # the branch ran here
    assert hook.misses >= 1 and processes_gone([pid])
    (second,) = hook.pids()  # a later step started a new worker
    assert second != pid
    pipemap.reset(pipe)
    assert processes_gone([second]) and not hasattr(pipe.transformer, "_hf_hook")


@pytest.mark.slow
def test_wan_planned_parallel_runs_its_second_branch_on_a_worker_and_equals_plain(monkeypatch):
    # the planner's own parallel plan (not a hand-made one): Wan calls its transformer once per guidance branch
    monkeypatch.delenv(ENV, raising=False)  # as a user runs it: ranks="auto", worker processes
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    plain = output(pipe(**fresh(call)))
    plan = pipemap.plan(pipe, hardware="2x64MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    assert (plan.placement("transformer").mode, plan.placement("transformer").replicas) == ("guidance", ("cuda:1",))
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceHook) and hook.runtime == "process"
    (pid,) = hook.pids()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)
    assert (hook.hits, hook.misses) == (STEPS - 1, 0) and hook.ranks.served == [pid] * (STEPS - 1)
    assert pid != os.getpid()
    pipemap.reset(pipe)
    assert processes_gone([pid])
