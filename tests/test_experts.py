"""Two denoising experts (Wan 2.2: ``transformer`` for the high-noise steps, ``transformer_2`` for the rest, switched
at ``boundary_ratio``): each priced at the steps the pipeline gives it (``pipemap.experts``, ``cost.predict``), and a
tiny two-expert Wan placed runs as plain diffusers does."""

from __future__ import annotations

import diffusers
import pytest
import torch

import families
import pipemap
from helpers import plain_pipeline
from pipemap import catalog, experts

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
WAN22 = "wan2.2-t2v-a14b"


def _scheduler_steps(scheduler, steps: int, boundary: float) -> int:
    scheduler.set_timesteps(steps, device="cpu")
    return sum(1 for t in scheduler.timesteps if float(t) >= boundary * scheduler.config.num_train_timesteps)


def test_each_expert_gets_the_steps_its_scheduler_gives_it():
    # the catalog's Wan 2.2 A14B: UniPC with flow_shift 12, boundary 0.875 (its published model_index and
    # scheduler_config): the high-noise expert runs the steps whose timestep is at or above 875
    entry = catalog.entry(WAN22)
    scheduler = diffusers.UniPCMultistepScheduler.from_config(entry.scheduler_config)
    first = _scheduler_steps(scheduler, 50, 0.875)
    assert experts.expert_steps(WAN22, set(experts.EXPERTS), 50) == {"transformer": first, "transformer_2": 50 - first}
    assert 0 < first < 50
    assert experts.expert_steps("flux.1-dev", {"transformer"}, 28) is None  # one denoiser: nothing to split


@pytest.mark.parametrize("count", [True, False])
def test_the_estimate_prices_each_expert_at_its_own_steps(count):
    # the recorded counts come from a two-step dry run, which only the high-noise expert ran; the formula prices
    # every denoiser at every call: both now give each expert its own steps, and the two together one call's work
    plan = pipemap.plan(WAN22, hardware="1x80GiB,cpu=256GiB,gpu=h100")
    found = pipemap.estimate(WAN22, plan, count=count).components
    steps = experts.expert_steps(WAN22, set(experts.EXPERTS), 50)
    assert found["transformer"].compute / found["transformer_2"].compute == pytest.approx(
        steps["transformer"] / steps["transformer_2"], rel=0.02)
    one = pipemap.estimate("wan2.1-t2v-14b", pipemap.plan("wan2.1-t2v-14b", hardware="1x80GiB,cpu=256GiB,gpu=h100"),
                           count=False, num_frames=81, height=480, width=832).components["transformer"].compute
    # Wan 2.1 14B's transformer is the same architecture as each expert: the experts' steps add up to its call
    assert found["transformer"].compute + found["transformer_2"].compute == pytest.approx(one, rel=0.1)


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    pipe, call = families.wan22_t2v()
    folder = tmp_path_factory.mktemp("wan22")
    pipe.save_pretrained(folder)
    plain = plain_pipeline(str(folder))
    ran = {name: 0 for name in experts.EXPERTS}
    handles = [getattr(plain, name).register_forward_hook(lambda *_, n=name: ran.__setitem__(n, ran[n] + 1))
               for name in experts.EXPERTS]
    reference = families.output(plain(**families.fresh(call)))
    for handle in handles:
        handle.remove()
    return str(folder), call, reference, ran


def test_a_tiny_two_expert_wan_splits_its_steps_as_the_estimate_says(wan22):
    folder, call, _reference, ran = wan22
    steps = experts.expert_steps(folder, set(experts.EXPERTS), call["num_inference_steps"])
    assert {name: 2 * n for name, n in steps.items()} == ran  # two calls a step (true CFG), each on its expert
    assert min(ran.values()) > 0  # the boundary falls inside the call: both experts run


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_memory"])
def test_a_tiny_two_expert_wan_placed_runs_as_plain(wan22, strategy):
    # balanced: two GPUs, the experts where the room is; balanced_low_memory: one GPU with room for one expert at a
    # time, so what does not fit is offloaded and brought in at its call: the idle expert waits in CPU RAM
    folder, call, reference, _ran = wan22
    inventory = pipemap.inspect(folder)
    sizes = [c.bytes for c in inventory.models]
    largest = max(c.bytes for c in inventory.models if c.name in experts.EXPERTS)
    hardware = (f"2x{max(int(0.6 * sum(sizes)), int(1.05 * max(sizes)))}B,cpu=1GiB" if strategy == "balanced"
                else f"1x{int(1.6 * largest)}B,cpu=1GiB")
    plan = pipemap.plan(folder, hardware=hardware, strategy=strategy, headroom=0.0)
    modes = {plan.placement(name).mode for name in experts.EXPERTS}
    assert modes == ({"resident"} if strategy == "balanced" else modes) and modes <= {"resident", "offload"}
    if strategy != "balanced":
        assert "offload" in modes
    pipe = pipemap.load(folder, plan=plan.remap(ON_CPU), progress=False)
    torch.testing.assert_close(families.output(pipe(**families.fresh(call))), reference, atol=1e-5, rtol=0)
    pipemap.reset(pipe)


@pytest.mark.parametrize("ranks", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_tiny_two_expert_wan_in_parallel_copies_both_experts_and_runs_as_plain(wan22, ranks):
    # two GPUs with room for both experts beside the rest: "parallel" gives each expert its guidance copy (each
    # step's second call on cuda:1, whichever expert the step runs), not the first expert alone; on threads and on
    # worker processes (a worker per expert's copy, each used at the steps of its expert)
    folder, call, reference, ran = wan22
    inventory = pipemap.inspect(folder)
    room = int(1.05 * sum(c.bytes for c in inventory.models))
    plan = pipemap.plan(folder, hardware=f"2x{room}B,cpu=1GiB", strategy="parallel", headroom=0.0)
    for name in experts.EXPERTS:
        assert (plan.placement(name).mode, plan.placement(name).replicas) == ("guidance", ("cuda:1",))
    assert any("transformer_2, the second expert" in note and "copied the same way" in note for note in plan.notes)
    pipe = pipemap.load(folder, plan=plan.remap(ON_CPU), progress=False, ranks=ranks)
    torch.testing.assert_close(families.output(pipe(**families.fresh(call))), reference, atol=1e-5, rtol=0)
    hooks = {name: getattr(pipe, name)._hf_hook for name in experts.EXPERTS}
    for name, hook in hooks.items():
        # each step's second call from the copy, but the expert's first step's (nothing was started ahead yet)
        assert hook.runtime == ranks and (hook.hits, hook.misses) == (ran[name] // 2 - 1, 0)
        assert (len(hook.pids()) == 1) == (ranks == "process")
    pipemap.reset(pipe)
