"""Known values in the dry run: what is computed from real inputs keeps its value; only weights are fake."""

from __future__ import annotations

import inspect

import diffusers
import numpy as np
import pytest
import torch
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from torch._subclasses.fake_tensor import FakeTensorMode

import pipemap
from families import build, fresh
from pipemap.dryrun import known, standin
from pipemap.dryrun.run import dry_call
from pipemap.dryrun.trackers import StorageTracker


@pytest.fixture
def dry():
    """A fake mode with one weight-like fake on meta:0 (unknown), and the known-value engine inside it."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        weight = torch.empty(4, 4, device="meta:0")
    with mode, known.known_values() as engine:
        yield engine, weight


def test_reads_of_values_computed_from_real_inputs(dry):
    engine, weight = dry
    ids = torch.tensor([[5, 7, 9, 0, 0]]).to("meta:0")
    mask = (ids != 0).long()
    assert ids.device == torch.device("meta:0") and ids[0, 1].item() == 7
    assert mask.tolist() == [[1, 1, 1, 0, 0]] and mask.sum().item() == 3
    assert ids[:, : int(mask.sum())].tolist() == [[5, 7, 9]]  # slicing by a computed length
    assert mask.cpu().numpy().tolist() == [[1, 1, 1, 0, 0]]
    image = torch.from_numpy(np.full((1, 3, 2, 2), 0.5, dtype=np.float32)).to("meta:0")
    assert not bool(image.min() < 0)  # img2img's "is it in [-1, 1] already?" branch
    t = torch.tensor(999.0).to("meta:0")
    assert torch.tensor([t / 1000]).tolist() == [pytest.approx(0.999)]  # AuraFlow's timestep
    assert torch.Tensor([0.25 * t.log()]).tolist() == [pytest.approx(0.25 * np.log(999.0))]  # the legacy constructor


def test_boolean_mask_of_known_values_indexes_weights_outputs(dry):
    engine, weight = dry
    hidden = weight.expand(2, 5, 4, 4).reshape(2, 5, 16) * 2  # depends on weights: unknown
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]).to("meta:0").bool()
    selected = hidden[mask]  # Qwen-Image and Kandinsky 3 read text states through the token mask
    assert selected.shape == (5, 16) and selected.device == torch.device("meta:0")
    assert known.real_value(selected) is None
    hidden[mask] = 0.0  # index_put_ through the mask
    assert hidden.shape == (2, 5, 16) and not engine.bounds
    with pytest.raises(known.UnknownValueError):
        hidden.sum().item()


def test_a_known_tensor_written_from_weights_becomes_unknown(dry):
    engine, weight = dry
    x = torch.zeros(4, 4).to("meta:0")
    view = x[0]
    assert view.tolist() == [0.0] * 4
    x.add_(1)  # known into known: still known, through the view too
    assert view.tolist() == [1.0] * 4
    x.copy_(weight)  # written from weights: unknown, and so is every view of it
    assert known.real_value(x) is not None and engine.value(x) is None and engine.value(view) is None


def test_known_values_count_once_on_their_stand_in_device():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = StorageTracker()
    with mode, tracker, known.known_values():
        ids = torch.arange(1 << 16).to("meta:0")  # 512 KiB of int64
        doubled = ids * 2
        assert doubled[-1].item() == 2 * ((1 << 16) - 1)
    # the CPU arange itself is freed; its CPU value beside the stand-in is never counted
    assert tracker.peak["meta:0"] == 2 * (8 << 16)
    assert tracker.peak["cpu"] == 8 << 16


# ---- schedules -------------------------------------------------------------------------------------------------


def _schedulers():
    names = [n for n in dir(diffusers) if n.endswith("Scheduler")]
    found = [getattr(diffusers, n) for n in names]
    return [c for c in found if inspect.isclass(c) and issubclass(c, SchedulerMixin) and "step" in c.__dict__]


def _denoise(scheduler, device, sample, model):
    scheduler.set_timesteps(2, device=device)
    seen = []
    for t in scheduler.timesteps:
        seen.append(float(t))
        scaled = scheduler.scale_model_input(sample, t) if hasattr(scheduler, "scale_model_input") else sample
        sample = scheduler.step(model(scaled), t, sample, return_dict=False)[0]
    return seen, sample


SCHEDULE_CASES = [(c, {}) for c in _schedulers()] + [
    (diffusers.DDPMScheduler, {"thresholding": True, "variance_type": "learned_range"}),  # DeepFloyd IF: quantile
    (diffusers.DDIMScheduler, {"clip_sample": True, "set_alpha_to_one": False}),
]


@pytest.mark.slow
def test_every_scheduler_diffusers_ships_runs_on_stand_ins():
    ran, skipped = [], []
    for cls, config in SCHEDULE_CASES:
        try:
            real, _ = _denoise(cls(**config), "cpu", torch.ones(1, 4, 8, 8), lambda x: x * 0.5)
        except Exception as err:  # a scheduler its default config cannot run on the CPU either  # noqa: BLE001
            skipped.append((cls.__name__, type(err).__name__))
            continue
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            weight = torch.empty(1, device="meta:0")
        scheduler = cls(**config)
        # as the dry run runs them: a generator asked for on a stand-in device is a CPU one (DPM++ SDE's torchsde)
        with mode, known.known_values(), standin.standin_generators():
            sample = torch.ones(1, 4, 8, 8, device="meta:0") * weight  # a latent: depends on weights
            stand_in, out = _denoise(scheduler, "meta:0", sample, sample.mul)
            assert out.shape == (1, 4, 8, 8) and out.device == torch.device("meta:0")
        assert stand_in == real, cls.__name__  # the same schedule, read from known values
        ran.append(cls.__name__)
    assert len(ran) >= 30, (ran, skipped)
    assert {"DDPMScheduler", "HeunDiscreteScheduler", "KDPM2AncestralDiscreteScheduler", "UniPCMultistepScheduler",
            "FlowMatchEulerDiscreteScheduler", "DPMSolverMultistepScheduler"} <= set(ran)


# ---- autocast and data-dependent shapes inside models ------------------------------------------------------------


def test_autocast_on_a_stand_in_device_acts_as_on_the_gpu_it_stands_for(dry):
    engine, weight = dry
    half = weight.to(torch.bfloat16)
    with torch.autocast(half.device.type, torch.float32):  # Mochi's rotary embedding
        assert (half @ half).dtype == torch.float32
        with torch.autocast(device_type=half.device.type, enabled=False):
            assert (half @ half).dtype == torch.bfloat16
    assert (half @ half).dtype == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16):  # the CPU keeps torch's own autocast
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_routing_counts_are_exact_when_known_and_a_bound_when_not(dry):
    engine, weight = dry
    experts = torch.tensor([0, 2, 2, 1]).to("meta:0")
    assert experts.bincount().cpu().numpy().tolist() == [1, 1, 2] and not engine.bounds
    routed = (weight[0] * 4).long()  # an expert index from a gate: depends on weights
    counts = routed.bincount().cpu().numpy()  # HiDream's mixture of experts
    assert counts.tolist() == [4] and engine.bounds == [
        "aten.bincount.default: every entry counted in the first bin (every token routed to one expert)"]


# ---- whole pipelines ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["aura_flow", "lumina2", "wan_t2v", "qwen_image", "sd_inpaint"])
def test_known_value_pipelines_dry_run_on_two_stand_in_gpus(family):
    pipe, call = build(family)
    plan = pipemap.plan(pipe, hardware="2x1GiB,cpu=4GiB", strategy="balanced", headroom=0.0)
    assert len({p.device for p in plan.components}) == 2
    call = fresh(call)
    report = pipemap.simulate(pipe, plan, steps=call.pop("num_inference_steps", 2), **call)
    assert report.ok, report.error
    assert not report.bound_peaks
    assert all(report.peak_bytes[d] > report.weight_bytes[d] > 0 for d in ("cuda:0", "cuda:1"))


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_mixture_of_experts_peak_is_reported_as_a_bound():
    pipe, call = build("hidream")
    plan = pipemap.plan(pipe, hardware="2x1GiB,cpu=4GiB", strategy="balanced", headroom=0.0)
    call = fresh(call)
    report = pipemap.simulate(pipe, plan, steps=call.pop("num_inference_steps", 2), **call)
    assert report.ok, report.error
    assert plan.device_map["transformer"] in report.bound_peaks
    assert "(bound)" in str(report) and "every token routed to one expert" in str(report)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen_image", "wan_t2v", "sd_img2img"])  # text masks, video, img2img
def test_single_device_peak_of_a_known_value_pipeline_matches_a_real_cpu_run(family):
    pipe, call = build(family)
    steps = call.pop("num_inference_steps", 2)
    tracker = StorageTracker()
    tracker.track_module_tensors(pipe)
    with tracker, torch.no_grad():
        pipe(**dry_call(pipe, steps, fresh(call)))
    real = tracker.peak["cpu"]
    report = pipemap.simulate(pipe, pipemap.plan(pipe, hardware="1x1GiB,cpu=4GiB"), steps=steps, **fresh(call))
    assert report.ok, report.error
    assert abs(report.peak_bytes["cuda:0"] - real) <= 0.10 * real, (report.peak_bytes, real)
