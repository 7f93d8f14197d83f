"""strategy="auto": the fastest plan that fits, by the cost model; splitting a component across GPUs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pipemap
from helpers import plain_pipeline, run
from pipemap import Component, Hardware, Inventory, Placement, catalog
from pipemap.cost import MEMORY_BYTES_PER_FLOP, Workload, formula_component, predict, seconds_per_image, workload_for
from pipemap.hooks import PlacementHook, SplitHook
from pipemap.planner import MIXED, STRATEGIES, TIE

GIB = 2**30


def model(name: str, size: int, blocks: int = 0, calls: int = 0) -> Component:
    """A model of ``size`` bytes; with ``blocks``, all but a tenth of it in that many equal list elements."""
    each = (size - size // 10) // blocks if blocks else 0
    shape = tuple((f"blocks.{i}", each) for i in range(blocks))
    in_flight = size // 10 + 2 * each if blocks else size
    return Component(name, "diffusers", "Model", size, True, calls_per_image=calls, in_flight=in_flight, blocks=shape)


def inventory(*models: Component) -> Inventory:
    return Inventory("test", "TestPipeline", models, "bfloat16")


def auto(inv: Inventory, hardware: str) -> pipemap.Plan:
    return pipemap.plan(inv, hardware=Hardware.parse(hardware), strategy="auto", headroom=0.0)


# text_encoder 2 GiB, unet 10 GiB (20 blocks), vae 1 GiB
SDXL_LIKE = inventory(model("text_encoder", 2 * GIB), model("unet", 10 * GIB, blocks=20), model("vae", GIB))


def test_auto_keeps_everything_resident_when_it_fits():
    plan = auto(SDXL_LIKE, "2x16GiB,cpu=64GiB")
    assert plan.strategy == "auto"
    assert {p.mode for p in plan.components} == {"resident"}
    assert plan.device_map == {"text_encoder": "cuda:1", "unet": "cuda:0", "vae": "cuda:1"}
    assert len(plan.candidates) == len(STRATEGIES) + len(MIXED)


# unet 10 GiB (20 blocks of 0.45 GiB, 1 GiB loose) fits no 8 GiB GPU whole; everything fits in 2 x 8 GiB
def test_auto_splits_what_fits_no_gpu_whole_but_fits_across_them():
    plan = auto(SDXL_LIKE, "2x8GiB,cpu=64GiB")
    unet = plan.placement("unet")
    assert unet.mode == "split" and unet.device == plan.execution_device
    assert {device for _, device, _ in unet.shards} == {"cuda:1"} and unet.device == "cuda:0"
    assert all(d.used <= d.budget for d in plan.devices)
    assert "balanced_split" in plan.notes[-1]


# text encoders 5 + 3 GiB, unet 10 GiB on one 14 GiB GPU: the text encoders must leave, the unet can stay
def test_auto_moves_the_text_encoders_before_the_denoiser():
    inv = inventory(model("text_encoder", 5 * GIB, blocks=24), model("text_encoder_2", 3 * GIB, blocks=12),
                    model("unet", 10 * GIB, blocks=20), model("vae", GIB))
    plan = auto(inv, "1x14GiB,cpu=64GiB")
    assert plan.placement("unet").mode == "resident"
    assert plan.placement("text_encoder").mode in ("offload", "stream")
    assert all(d.used <= d.budget for d in plan.devices)


def test_explain_lists_every_candidate_and_the_winner():
    plan = auto(SDXL_LIKE, "2x8GiB,cpu=64GiB")
    text = plan.explain()
    for name in (*STRATEGIES, *MIXED):
        assert name in text
    assert "does not fit" in text and "fastest plan that fits" in text
    assert pipemap.Plan.from_json(plan.to_json()) == plan


def test_explain_of_a_fixed_strategy_says_so():
    assert "no other plan was weighed" in pipemap.plan(SDXL_LIKE, hardware="2x16GiB").explain()


def test_nothing_fits_names_the_largest():
    with pytest.raises(pipemap.DoesNotFitError) as err:
        auto(inventory(model("unet", 10 * GIB)), "1x4GiB,cpu=64GiB")
    assert err.value.component == "unet" and err.value.strategy == "auto"


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5), gpus=st.lists(st.integers(8, 60), min_size=1,
                                                                                    max_size=3))
def test_auto_fits_and_is_never_slower_than_a_fixed_strategy(sizes, gpus):
    names = ["unet", "text_encoder", "text_encoder_2", "vae", "controlnet"]
    inv = inventory(*(model(names[i], size * GIB // 4, blocks=8) for i, size in enumerate(sizes)))
    hw = Hardware.parse(",".join(f"cuda:{i}={g * GIB // 4}" for i, g in enumerate(gpus)) + ",cpu=64GiB")
    try:
        plan = pipemap.plan(inv, hardware=hw, strategy="auto", headroom=0.0)
    except pipemap.DoesNotFitError:
        for name in (*STRATEGIES, *MIXED):
            with pytest.raises(pipemap.DoesNotFitError):
                pipemap.plan(inv, hardware=hw, strategy=name, headroom=0.0)
        return
    assert all(d.used <= d.budget for d in plan.devices if d.device != "cpu")
    best = seconds_per_image(plan, inv, hw.performance)
    for name in (*STRATEGIES, *MIXED):
        try:
            fixed = pipemap.plan(inv, hardware=hw, strategy=name, headroom=0.0)
        except pipemap.DoesNotFitError:
            continue
        # never slower past a tie: within TIE, auto takes the plan moving fewer bytes over the host link
        assert best <= seconds_per_image(fixed, inv, hw.performance) * (1 + TIE) + 1e-12


# ---- the cost model --------------------------------------------------------------------------------------------


def test_cost_counts_moves_by_mode():
    perf = Hardware.parse("1x24GiB,flops=100T,host_bw=25GB").performance
    unet = model("unet", 10 * GIB, blocks=20)
    inv = inventory(unet)
    placements = {mode: Placement("unet", "cpu" if mode in ("offload", "stream") else "cuda:0", unet.bytes, mode,
                                  "cuda:0") for mode in ("resident", "offload", "stream")}
    costs = {mode: predict(pipemap.Plan("x", (p,), (), "cuda:0", "bfloat16"), inv, perf, Workload())["unet"]
             for mode, p in placements.items()}
    assert costs["resident"].transfer == 0
    assert costs["offload"].transfer == pytest.approx(unet.bytes / 25e9, rel=1e-3)  # and a latency a copy
    assert costs["stream"].transfer == pytest.approx(unet.calls_per_image * unet.bytes / 25e9, rel=1e-2)
    assert costs["resident"].total < costs["offload"].total < costs["stream"].total


def test_hardware_spec_carries_performance_figures():
    perf = Hardware.parse("2x24GiB,gpu=4090,flops=200T,peer_bw=10GB").performance
    assert (perf.flops, perf.host_bandwidth, perf.peer_bandwidth) == (200e12, 25e9, 10e9)
    with pytest.raises(pipemap.HardwareSpecError):
        Hardware.parse("2x24GiB,flops=fast")


# ---- split on stand-in GPUs and for real --------------------------------------------------------------------------

# tiny models: unet 3.0 MiB, vae 2.5, controlnet 1.6, text encoders 0.2; GPUs too small for the unet or the vae
SPLIT_GPUS = {"sd": "3x2.4MiB,cpu=1GiB", "sdxl": "3x2.4MiB,cpu=1GiB", "controlnet": "3x2.9MiB,cpu=1GiB"}
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu", "cuda:2": "cpu"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SPLIT_GPUS))
def test_split_pipeline_runs_clean_on_stand_in_gpus_and_equals_plain_on_cpu(tiny_folders, reference_outputs, kind):
    folder = tiny_folders[kind]
    plan = pipemap.plan(folder, hardware=SPLIT_GPUS[kind], strategy="balanced_split", headroom=0.0)
    assert any(p.mode == "split" for p in plan.components)
    report = pipemap.simulate(folder, plan, advice=False)  # the figures only: no tiling advice's second dry run
    assert report.ok, report.error
    for device in plan.devices:
        if device.used:
            assert report.weight_bytes[device.device] == pytest.approx(device.used, rel=0.01)
    pipe = pipemap.load(folder, plan=plan.remap(ON_CPU), progress=False)
    split = [p for p in plan.components if p.mode == "split"][0]
    module = getattr(pipe, split.component)
    assert isinstance(module._hf_hook, SplitHook)
    assert all(isinstance(module.get_submodule(path)._hf_hook, PlacementHook) for path, _, _ in split.shards)
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    pipemap.reset(pipe)
    assert not any(hasattr(m, "_hf_hook") for m in module.modules())


@pytest.mark.slow
def test_split_dispatch_of_a_loaded_pipeline_in_the_dry_run(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    plan = pipemap.plan(pipe, hardware=SPLIT_GPUS["sdxl"], strategy="auto", headroom=0.0)
    report = pipemap.simulate(pipe, plan)
    assert report.ok, report.error


@pytest.mark.slow
def test_catalog_pipeline_auto_plan_through_the_command_line():
    from helpers import pipemap_cli

    result = pipemap_cli("plan", "flux.1-dev", "--hardware", "2x16GiB,cpu=64GiB", "--strategy", "auto")
    assert result.returncode == 0, result.stderr
    assert "transformer" in result.stdout and "auto:" in result.stdout


def test_split_blocks_go_straight_to_their_gpu_never_through_the_first(tiny_folders):
    # home is the meta device here, the shard stays on the CPU: a block that passed through home would be moved
    from pipemap.dispatch import place_component

    unet = plain_pipeline(tiny_folders["sd"]).unet
    block = unet.up_blocks[0]
    placement = Placement("unet", "meta", 0, "split", "meta", shards=(("up_blocks.0", "cpu", 0),))
    moves = place_component(unet, placement)
    block_tensors = {id(t) for t in list(block.parameters()) + list(block.buffers())}
    assert moves and not any(id(m.original) in block_tensors for m in moves)
    assert {p.device.type for p in block.parameters()} == {"cpu"}
    assert {p.device.type for p in unet.conv_in.parameters()} == {"meta"}


def test_the_formula_prices_long_video_attention_at_its_backends_rate_and_moves_no_bytes_for_it():
    # Wan 2.1 14B at 1280x720x81 frames: 75,600 tokens a call, ~70% of the formula's FLOPs in self-attention, which
    # a fused kernel runs without the memory-bound traffic the median rate gives other FLOPs; so the backend the
    # stack runs (FlashAttention-3 on Hopper, as Wan's own code picks it) sets most of the price
    inventory = pipemap.inspect("wan2.1-t2v-14b")
    call = {"height": 720, "width": 1280, "num_frames": 81}
    work = workload_for(inventory, call)
    counted = formula_component(inventory["transformer"], 2, work).per_call(work.steps)
    assert work.latent_tokens == 75_600 and counted.attention_flops > 0.6 * counted.flops
    assert counted.memory_bytes == pytest.approx((counted.flops - counted.attention_flops) * MEMORY_BYTES_PER_FLOP)
    plan = pipemap.plan(inventory, hardware="1x80GiB,cpu=256GiB,gpu=h100")
    fa2, fa3 = (pipemap.estimate(inventory, plan, hardware=f"1x80GiB,cpu=256GiB,gpu=h100,attention={backend}",
                                 **call).seconds for backend in ("flash", "fa3"))
    assert fa2 > 1.4 * fa3


@pytest.mark.parametrize("name", catalog.names())
def test_each_catalog_pipeline_s_default_call_row_makes_the_denoiser_calls_its_recorded_dry_run_made(name):
    # the default call's guidance decides whether "parallel" gives a copy to a second branch a step: a class with no
    # row (the 1024x1024, 50 steps, true CFG fallback) had FLUX.2 and Qwen-Image-Edit copy a branch no call makes
    from pipemap.cost import PIPELINE_DEFAULTS
    from pipemap.dryrun.counted import known_counts
    from pipemap.replication import batches_guidance

    inventory = pipemap.inspect(name)
    assert inventory.pipeline_class in PIPELINE_DEFAULTS
    counts = known_counts(name, inventory.dtype)
    assert counts is not None
    denoisers = [c for c in counts.components if c.component in ("unet", "transformer", "transformer_2")]
    calls = sum(c.calls_per_step for c in denoisers)  # Wan 2.2's two experts share the steps
    work = workload_for(inventory)
    batched = batches_guidance(inventory.pipeline_class)
    assert calls == pytest.approx(1 if batched else (2 if work.guidance else 1), abs=0.05), (calls, work)
