"""pipemap.estimate: seconds of a call from the work a dry run counts at the call's shapes, responding to steps,
size, frames, images and guidance as the pipeline does; counts kept by call shape and used by "auto"."""

from __future__ import annotations

import pytest

import families
import pipemap
from pipemap.dryrun import counted

# a GPU slow enough that its work, not the launches, sets every time: FLOPs and bytes show in the seconds
SLOW = "1x1GiB,cpu=4GiB,flops=1000000,mem_bw=1MB"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    counted.clear_counts()
    yield
    counted.clear_counts()


def _dry_runs(monkeypatch) -> list:
    calls = []
    run = counted.count_work
    monkeypatch.setattr(counted, "count_work", lambda *a, **k: calls.append(k) or run(*a, **k))
    return calls


def _denoiser(estimate: pipemap.Estimate, name: str = "unet") -> float:
    return estimate.components[name].compute


@pytest.mark.slow
def test_estimate_follows_steps_from_one_count_and_keeps_it(tiny_folders, monkeypatch):
    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware=SLOW)
    runs = _dry_runs(monkeypatch)
    two, four, eight = (pipemap.estimate(folder, plan, hardware=SLOW, num_inference_steps=n) for n in (2, 4, 8))
    assert len(runs) == 1  # one dry run: steps do not change the shape
    assert two.work.steps == 2 and eight.work.steps == 8
    assert _denoiser(eight) == pytest.approx(4 * _denoiser(two))  # per step
    assert eight.seconds - four.seconds == pytest.approx(2 * (four.seconds - two.seconds))  # linear in steps
    assert two.components["vae"].compute == eight.components["vae"].compute  # once per image
    assert "dry run" in two.priced_by
    assert two.compute == pytest.approx(sum(c.compute for c in two.components.values()))


@pytest.mark.slow
def test_estimate_follows_size_images_and_guidance_as_the_pipeline_does(tiny_folders):
    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware=SLOW)
    base = pipemap.estimate(folder, plan, hardware=SLOW, height=32, width=32)
    larger = pipemap.estimate(folder, plan, hardware=SLOW, height=64, width=64)
    assert _denoiser(larger) > 3.5 * _denoiser(base)  # 4x the latent pixels
    two = pipemap.estimate(folder, plan, hardware=SLOW, height=32, width=32, num_images_per_prompt=2)
    assert _denoiser(two) == pytest.approx(2 * _denoiser(base), rel=0.01) and two.images == 2
    assert two.per_image == pytest.approx(two.seconds / 2)
    # guidance_scale 1: SD's pipeline drops the unconditional half of its batch, and the negative prompt's encoding
    plain = pipemap.estimate(folder, plan, hardware=SLOW, height=32, width=32, guidance_scale=1.0)
    assert _denoiser(plain) == pytest.approx(_denoiser(base) / 2, rel=0.01)
    assert plain.components["text_encoder"].compute < base.components["text_encoder"].compute


@pytest.mark.slow
def test_true_cfg_that_needs_a_negative_prompt_is_one_call_a_step_without_one():
    pipe, call = families.build("qwen_image")
    plan = pipemap.plan(pipe, hardware=SLOW)
    shape = {k: call[k] for k in ("height", "width", "max_sequence_length")}
    without = pipemap.estimate(pipe, plan, hardware=SLOW, true_cfg_scale=4.0, **shape)
    with_negative = pipemap.estimate(pipe, plan, hardware=SLOW, true_cfg_scale=4.0, negative_prompt="blurry",
                                     **shape)
    assert _denoiser(with_negative, "transformer") == pytest.approx(2 * _denoiser(without, "transformer"), rel=0.02)
    assert not without.work.guidance and with_negative.work.guidance


@pytest.mark.slow
def test_estimate_follows_frames():
    pipe, call = families.build("wan_t2v")
    plan = pipemap.plan(pipe, hardware=SLOW)
    shape = {k: call[k] for k in ("height", "width", "max_sequence_length")}
    five, nine = (pipemap.estimate(pipe, plan, hardware=SLOW, num_frames=n, **shape) for n in (5, 9))
    # 3 latent frames against 2 (the tiny model's text and timestep layers do not grow with them); 9 frames decoded
    assert _denoiser(nine, "transformer") > 1.1 * _denoiser(five, "transformer")
    assert nine.components["vae"].compute > 1.5 * five.components["vae"].compute
    assert nine.work.frames == 9


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_a_catalog_default_call_is_priced_by_its_record_without_a_dry_run(monkeypatch):
    runs = _dry_runs(monkeypatch)
    plan = pipemap.plan("qwen-image", hardware="1x141GiB,cpu=256GiB")
    found = pipemap.estimate("qwen-image", plan, hardware="1x141GiB,cpu=256GiB,gpu=h200")
    assert runs == [] and found.priced_by == "recorded counts"
    assert found.work.steps == 50 and not found.work.guidance  # no negative prompt: one call a step
    assert "1 call a step" in str(found)


def test_an_inventory_is_priced_by_the_formula():
    inventory = pipemap.inspect("stable-diffusion-1.5")
    plan = pipemap.plan(inventory, hardware="1x24GiB,cpu=64GiB")
    assert pipemap.estimate(inventory, plan, hardware="1x24GiB,gpu=4090").priced_by.startswith("the formula")


@pytest.mark.slow
def test_auto_prices_by_the_counts_once_known_and_says_so(tiny_folders):
    folder = tiny_folders["sdxl"]
    before = pipemap.plan(folder, hardware="1x1GiB,cpu=4GiB", strategy="auto")
    assert "formula" in before.explain()
    pipemap.estimate(folder, before, hardware="1x1GiB,cpu=4GiB")  # the default call, counted and kept
    after = pipemap.plan(folder, hardware="1x1GiB,cpu=4GiB", strategy="auto")
    assert "a dry run counted" in after.explain()
    catalog = pipemap.plan("flux.1-dev", hardware="1x24GiB,cpu=64GiB", strategy="auto")
    assert "recorded, 28 steps" in catalog.explain()


def test_an_estimate_prices_the_plan_on_the_machine_it_was_made_for():
    inventory = pipemap.inspect("flux.1-dev")  # a large denoiser: the GPU's speed, not the launches, sets its time
    h100 = "1x80GiB,cpu=128GiB,gpu=h100"
    plan = pipemap.plan(inventory, hardware=h100)
    own = pipemap.estimate(inventory, plan)
    assert own.seconds == pipemap.estimate(inventory, plan, hardware=h100).seconds
    assert own.seconds == pipemap.estimate(inventory, pipemap.Plan.from_json(plan.to_json())).seconds
    # another machine when asked: a T4 is slower
    assert pipemap.estimate(inventory, plan, hardware="1x80GiB,cpu=128GiB,gpu=t4").seconds > 2 * own.seconds


def test_an_estimate_says_where_its_gpu_speeds_come_from():
    inventory = pipemap.inspect("flux.1-dev")
    plan = pipemap.plan(inventory, hardware="1x48GiB,cpu=128GiB,gpu=l20")
    found = pipemap.estimate(inventory, plan)
    assert found.speeds == plan.performance.origin and "no L20 fit" in found.speeds
    assert "GPU speeds: L20 datasheet" in str(found)


def test_a_launch_bound_call_is_flagged_in_the_estimate_and_in_auto_explain():
    # SD 1.5's small UNet on an H100: its ~kernels x 40 us of launches outlast the GPU's work; FLUX.1-dev's do not
    h100 = "1x80GiB,cpu=128GiB,gpu=h100"
    small = pipemap.inspect("stable-diffusion-1.5")
    found = pipemap.estimate(small, pipemap.plan(small, hardware=h100))
    assert found.components["unet"].launch_bound and "launch-bound: " in str(found) and "unet" in str(found)
    assert "launch-bound: " in pipemap.plan(small, hardware=h100, strategy="auto").explain()
    large = pipemap.inspect("flux.1-dev")
    assert not pipemap.estimate(large, pipemap.plan(large, hardware=h100)).components["transformer"].launch_bound


def test_a_small_launch_bound_part_of_a_call_is_not_flagged():
    # FLUX.1-dev on an H100: its text encoders wait for their launches, but take well under 5% of the call
    inventory = pipemap.inspect("flux.1-dev")
    found = pipemap.estimate(inventory, pipemap.plan(inventory, hardware="1x80GiB,cpu=128GiB,gpu=h100"))
    assert found.components["text_encoder"].launch_bound and "launch-bound" not in str(found)


# ---- more GPUs, priced as published runs scale (issue 50) --------------------------------------------------------
# Each published speed-up is a ratio of one source's own runs; the seconds are the estimate's, for H100s.
H100 = "{}x80GiB,cpu=256GiB,gpu=h100"
NEGATIVE = {"negative_prompt": " ", "true_cfg_scale": 4.0}  # Qwen-Image's true CFG: two transformer calls a step


def _speedup(name: str, gpus: int, count: bool = True, **call) -> tuple[float, pipemap.Plan]:
    """One H100's estimate of ``call`` over ``gpus`` H100s' ("auto" planning for that very call: no dry run)."""
    # the published runs' ranks are processes, each launching in its own interpreter (threads: one after the other)
    one = pipemap.plan(name, hardware=H100.format(1), strategy="auto", call=call or None, ranks="process")
    many = pipemap.plan(name, hardware=H100.format(gpus), strategy="auto", call=call or None, ranks="process")
    seconds = [pipemap.estimate(name, p, count=count, **call).seconds for p in (one, many)]
    return seconds[0] / seconds[1], many


def test_flux_on_two_h100s_is_as_much_faster_as_published():
    # xDiT, FLUX.1-dev at 1024px, 28 steps, no torch.compile: 6.71 s on 1 H100, 4.38 s on 2 (Ulysses-2): 1.53x
    # (https://github.com/xdit-project/xDiT/blob/main/docs/performance/flux.md; the Hopper host's launch default is
    # fitted on that 2-GPU row, bench/CALIBRATION.md); ParaAttention 1.65x on 2 A100s. The recorded counts price it.
    gain, plan = _speedup("flux.1-dev", 2)
    assert gain >= 1.5
    transformer = plan.placement("transformer")
    assert (transformer.mode, len(transformer.replicas)) == ("sequence", 1)  # one call a step: its tokens split


def test_flux_on_four_h100s_gains_as_little_over_two_as_published():
    # the same source: Ulysses-4 on 4 H100s 4.24 s against Ulysses-2's 4.38 s in eager PyTorch (1.63 s with
    # torch.compile, which removes most launches): each rank launches every kernel of its share, and with a quarter
    # of the tokens each the host's launches set the pace. A host stated faster (launch=) lets four GPUs pull ahead
    two, _plan = _speedup("flux.1-dev", 2)
    four, plan = _speedup("flux.1-dev", 4)
    assert len(plan.placement("transformer").replicas) == 3 and 0.9 < four / two < 1.1
    assert "launch-bound" in str(pipemap.estimate("flux.1-dev", plan))
    fast = H100.format(4) + ",launch=5us"
    assert pipemap.estimate("flux.1-dev", plan, hardware=fast).seconds < 0.8 * pipemap.estimate(
        "flux.1-dev", plan).seconds


def test_qwen_image_with_a_negative_prompt_on_two_h100s_is_as_much_faster_as_published():
    # cache-dit's Qwen-Image on 2 H100s with negative_prompt=' ', true_cfg_scale=4.0: 1.86x one H100's time
    # (https://github.com/vipshop/cache-dit/blob/main/docs/benchmark/NVIDIA_GPU.md); vLLM-Omni's CFG split at 2048px
    # 1.73x. Priced by the formula (counting this call would take a full-size dry run)
    gain, plan = _speedup("qwen-image", 2, count=False, **NEGATIVE)
    assert gain >= 1.7
    assert plan.placement("transformer").mode == "guidance"  # the second call of each step on the other GPU


def test_qwen_image_at_2048_with_a_negative_prompt_on_four_h100s():
    # issue 50's must-show: at least 2.5x on four GPUs (vLLM-Omni's Ulysses-4 gives 2.84x; their rows are Ulysses
    # alone, the test below). Four GPUs: each guidance branch's tokens over two of them
    gain, plan = _speedup("qwen-image", 4, count=False, height=2048, width=2048, **NEGATIVE)
    assert gain >= 2.5
    transformer = plan.placement("transformer")
    assert (transformer.mode, len(transformer.replicas)) == ("guidance_sequence", 3)
    # from 4 to 8 GPUs the exchanges' latency grows with the ranks: less than twice as fast again
    eight, _plan = _speedup("qwen-image", 8, count=False, height=2048, width=2048, **NEGATIVE)
    assert gain < eight < 2 * gain


def test_parallel_puts_qwen_images_transformer_on_all_four_gpus():
    # its default call (no negative prompt: one call a step) splits the tokens four ways; with a negative prompt at
    # 2048x2048 (call=) each guidance branch's tokens go to two of them
    plain = pipemap.plan("qwen-image", hardware=H100.format(4), strategy="parallel")
    negative = pipemap.plan("qwen-image", hardware=H100.format(4), strategy="parallel",
                            call={**NEGATIVE, "height": 2048, "width": 2048})
    for plan, mode in ((plain, "sequence"), (negative, "guidance_sequence")):
        transformer = plan.placement("transformer")
        assert (transformer.mode, {transformer.device, *transformer.replicas}) == (
            mode, {"cuda:0", "cuda:1", "cuda:2", "cuda:3"})
    assert "1 call a step" in plain.explain() and "true CFG, 2 calls a step" in negative.explain()


def test_the_estimate_prices_the_runtime_the_plan_names():
    # the same split with its ranks as worker processes and as threads of one process (issue 48's runtimes): threads
    # launch one after the other through one interpreter lock, so the same plan is slower, and the estimate says so
    process, thread = (pipemap.plan("flux.1-dev", hardware=H100.format(2), strategy="parallel", ranks=ranks)
                       for ranks in ("process", "thread"))
    seconds = {p.ranks: pipemap.estimate("flux.1-dev", p) for p in (process, thread)}
    assert seconds["thread"].seconds > 1.3 * seconds["process"].seconds
    assert "ranks: priced as worker processes" in str(seconds["process"])
    assert "ranks: priced as threads of one process" in str(seconds["thread"])
    alone = pipemap.estimate("flux.1-dev", pipemap.plan("flux.1-dev", hardware=H100.format(1)))
    assert alone.ranks is None and "ranks:" not in str(alone)


@pytest.mark.parametrize(("gpus", "published"), [(1, 112.5), (2, 65.2), (4, 39.6), (8, 30.8)])
def test_qwen_image_at_2048_over_h800s_is_priced_as_vllm_omni_ran_it(gpus, published):
    # vLLM-Omni's parallelism guide: Qwen/Qwen-Image at 2048x2048, 50 steps, NVIDIA H800s, sdpa: diffusers 112.5 s
    # on one, Ulysses-SP over 2 / 4 / 8: 65.2 / 39.6 / 30.8 s (1.73x / 2.84x / 3.65x; two transformer calls a step,
    # as the 1-GPU time says). Priced by the formula, each rank a worker process; the 8-GPU row is the one
    # STRAGGLER_WAIT is fitted on (bench/CALIBRATION.md, with the recorded counts)
    hardware = f"{gpus}x80GiB,cpu=256GiB,gpu=h800"
    plan = pipemap.plan("qwen-image", hardware=hardware, strategy="parallel" if gpus > 1 else "auto", ranks="process")
    transformer = plan.placement("transformer")
    assert len(transformer.replicas) == gpus - 1 and transformer.mode == ("sequence" if gpus > 1 else "resident")
    seconds = pipemap.estimate("qwen-image", plan, count=False, height=2048, width=2048, **NEGATIVE).seconds
    assert 0.9 < seconds / published < 1.15


WAN_720 = {"height": 720, "width": 1280, "num_frames": 81, "num_inference_steps": 50}


@pytest.mark.parametrize(("gpus", "published"), [(1, 1837.9), (2, 945.1), (4, 497.0), (8, 287.9)])
def test_wan_at_720p_over_h100s_is_priced_as_its_readme_ran_it(gpus, published):
    # the Wan 2.1 README's table (assets/comp_effic.png): T2V-14B at 1280x720x81, 50 steps, two transformer calls a
    # step, on 1 / 2 / 4 / 8 H800/H100s: 1837.9 / 945.1 / 497.0 / 287.9 s, both calls of a step over every GPU's
    # share of the tokens (Ulysses-N). A share of a rank's work per rank beyond two priced 8 GPUs at 1.45x; a wait
    # per collective (STRAGGLER_WAIT) leaves a long sequence's split near its share. Priced by the formula
    hardware = H100.format(gpus)
    plan = pipemap.plan("wan2.1-t2v-14b", hardware=hardware, strategy="parallel" if gpus > 1 else "auto",
                        call={**WAN_720, "guidance_scale": 1.0}, ranks="process")
    transformer = plan.placement("transformer")
    assert len(transformer.replicas) == gpus - 1 and transformer.mode == ("sequence" if gpus > 1 else "resident")
    seconds = pipemap.estimate("wan2.1-t2v-14b", plan, count=False, **WAN_720).seconds
    assert 0.8 < seconds / published < 1.25


WAN22_720 = {"height": 720, "width": 1280, "num_frames": 81, "num_inference_steps": 40}


@pytest.mark.parametrize(("gpus", "published"), [(1, 1041.5), (8, 155.1)])
def test_wan22_experts_over_h100s_are_priced_as_its_readme_ran_them(gpus, published):
    # the Wan 2.2 README's table (assets/comp_effic.png): T2V-A14B at 1280x720x81, 40 steps, two calls a step,
    # FlashAttention-3 on Hopper (as the README says), on 1 / 8 H100/H800s: 1041.5 / 155.1 s. Its two experts take
    # turns by timestep (pipemap.experts), each split over all eight GPUs. Priced by the formula
    hardware = H100.format(gpus) + ",attention=fa3"
    plan = pipemap.plan("wan2.2-t2v-a14b", hardware=hardware, strategy="parallel" if gpus > 1 else "auto",
                        call={**WAN22_720, "guidance_scale": 1.0, "guidance_scale_2": 1.0}, ranks="process")
    for expert in ("transformer", "transformer_2"):
        placement = plan.placement(expert)
        assert placement.mode == ("sequence" if gpus > 1 else "resident") and len(placement.replicas) == gpus - 1
    seconds = pipemap.estimate("wan2.2-t2v-a14b", plan, count=False, **WAN22_720).seconds
    assert 0.8 < seconds / published < 1.25


def test_hunyuanvideo_is_priced_at_its_own_default_call():
    # diffusers' HunyuanVideoPipeline: 1280x720, 129 frames, 50 steps, guidance embedded in the transformer's input
    # (one call a step; true CFG only with a negative prompt and true_cfg_scale > 1)
    inventory = pipemap.inspect("hunyuanvideo")
    work = pipemap.cost.workload_for(inventory)
    assert (work.width, work.height, work.frames, work.steps, work.calls) == (1280, 720, 129, 50, 50)
    assert pipemap.cost.workload_for(inventory, {"negative_prompt": "", "true_cfg_scale": 6.0}).calls == 100


def test_auto_prices_its_splits_for_the_runtime_that_will_run_them():
    # FLUX.1-dev on two H100s is launch-bound once split: as worker processes each rank launches in parallel and
    # the split wins (xDiT: 1.53x); as threads of one process the two ranks' launches take turns on one interpreter,
    # so auto keeps every call on one GPU
    process, thread = (pipemap.plan("flux.1-dev", hardware=H100.format(2), strategy="auto", ranks=ranks)
                       for ranks in ("process", "thread"))
    assert process.placement("transformer").mode == "sequence" and process.ranks == "process"
    assert not thread.placement("transformer").replicas and thread.ranks is None
