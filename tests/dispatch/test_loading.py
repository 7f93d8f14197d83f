"""load(): a folder loaded onto its plan runs like plain diffusers, for every strategy; built components join in."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import plain_pipeline, run
from pipemap import tiny
from pipemap.dispatch import planned
from pipemap.dispatch.loading import with_passed
from pipemap.hardware import Hardware
from pipemap.hooks import PlacementHook

TWO_GPUS = "cuda:0=5MiB,cuda:1=5MiB,cpu=1GiB"  # tiny models: unet 3.0 MiB, vae 2.5, controlnet 1.6, text encoders 0.2
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
STRATEGIES = ["balanced", "sequential", {"vae": "cuda:0", "unet": "cuda:1"}, {"unet": "cuda:1"}]


def _models(pipe) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _assert_placed(pipe, plan):
    assert pipe.hf_device_map == plan.device_map
    for name, module in _models(pipe).items():
        assert {t.device for t in module.state_dict().values()} == {torch.device(plan.device_map[name])}
        assert isinstance(module._hf_hook, PlacementHook)


@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=["balanced", "sequential", "full-map", "partial-map"])
def test_load_equals_plain_for_every_strategy(tiny_folders, reference_outputs, kind, strategy):
    folder = tiny_folders[kind]
    plan = pipemap.plan(folder, hardware=TWO_GPUS, strategy=strategy, headroom=0.0)
    assert set(plan.device_map.values()) == {"cuda:0", "cuda:1"}
    pipe = pipemap.load(folder, plan=plan.remap(ON_CPU), progress=False)
    _assert_placed(pipe, plan.remap(ON_CPU))
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    pipemap.reset(pipe)
    assert not any(hasattr(m, "_hf_hook") for module in _models(pipe).values() for m in module.modules())


def test_load_plans_for_this_machine_with_diffusers_arguments(tiny_folders, reference_outputs):
    pipe = pipemap.load(tiny_folders["sd"], device_map="balanced", max_memory={"cpu": "1GiB"}, progress=False)
    assert planned(pipe).device_map == {"vae": "cpu", "text_encoder": "cpu", "unet": "cpu"}
    assert any("no GPU" in note for note in planned(pipe).notes)
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_load_at_fp16_equals_plain_fp16(tiny_folders):
    folder = tiny_folders["sd"]
    pipe = pipemap.load(folder, hardware="cpu=1GiB", torch_dtype=torch.float16, variant="fp16", progress=False)
    assert {m.dtype for m in _models(pipe).values()} == {torch.float16}
    assert planned(pipe).dtype == "float16"
    plain = plain_pipeline(folder, dtype=torch.float16, variant="fp16")
    torch.testing.assert_close(run(pipe, "sd"), run(plain, "sd"), atol=1e-5, rtol=0)


def test_component_passed_in_is_placed_and_hooked(tiny_folders, reference_outputs):
    folder = tiny_folders["controlnet"]
    controlnet = plain_pipeline(folder).controlnet
    plan = pipemap.plan(with_passed(pipemap.inspect(folder), {"controlnet": controlnet}),
                        hardware=TWO_GPUS, headroom=0.0)
    assert plan.placement("controlnet").bytes == pipemap.inventory.module_bytes(controlnet)
    pipe = pipemap.load(folder, plan=plan.remap(ON_CPU), controlnet=controlnet, progress=False)
    assert pipe.controlnet is controlnet and isinstance(controlnet._hf_hook, PlacementHook)
    torch.testing.assert_close(run(pipe, "controlnet"), reference_outputs["controlnet"], atol=1e-5, rtol=0)


def test_passed_component_planned_without_a_plan(tiny_folders):
    folder = tiny_folders["controlnet"]
    controlnet = plain_pipeline(folder).controlnet
    pipe = pipemap.load(folder, hardware="cpu=1GiB", controlnet=controlnet, progress=False)
    assert "controlnet" in pipe.hf_device_map and isinstance(controlnet._hf_hook, PlacementHook)


@pytest.mark.parametrize("given", ["hardware", "plan"])
def test_gpus_this_machine_lacks_run_on_the_cpu_with_a_warning(tiny_folders, reference_outputs, monkeypatch, given):
    # the README's budget for a tiny folder on a machine without GPUs: load runs it as `pipemap run` and `demo` do
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls, reserve=0: Hardware.parse("cpu=1GiB")))
    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware="2x5MiB,cpu=1GiB")
    arguments = {"hardware": "2x5MiB,cpu=1GiB"} if given == "hardware" else {"plan": plan}
    with pytest.warns(UserWarning, match="lacks cuda:0, cuda:1 of the plan: running the same plan with them on the"):
        pipe = pipemap.load(folder, progress=False, **arguments)
    assert planned(pipe) == plan.remap(ON_CPU) and set(plan.device_map.values()) == {"cuda:0", "cuda:1"}
    _assert_placed(pipe, plan.remap(ON_CPU))
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)


def test_a_stand_in_device_is_still_refused(tiny_folders):
    plan = pipemap.plan(tiny_folders["sd"], hardware="2x5MiB,cpu=1GiB").remap({"cuda:0": "meta:0", "cuda:1": "meta:1"})
    with pytest.raises(pipemap.UnknownDeviceError, match="not on this machine"):
        pipemap.load(tiny_folders["sd"], plan=plan, progress=False)


def test_max_memory_naming_a_missing_gpu_is_an_error(tiny_folders):
    with pytest.raises(pipemap.UnknownDeviceError) as err:
        pipemap.load(tiny_folders["sd"], device_map="balanced", max_memory={0: "20GiB", 1: "20GiB"}, progress=False)
    assert err.value.device == "cuda:0" and "cpu" in err.value.available


def test_strategy_and_device_map_must_agree(tiny_folders):
    with pytest.raises(pipemap.ArgumentConflictError):
        pipemap.load(tiny_folders["sd"], strategy="balanced", device_map="sequential", progress=False)


def test_unknown_component_in_map_lists_the_real_ones(tiny_folders):
    with pytest.raises(pipemap.UnknownComponentError) as err:
        pipemap.plan(tiny_folders["sd"], hardware=TWO_GPUS, device_map={"unett": "cuda:0"})
    assert err.value.component == "unett" and set(err.value.known) == {"vae", "text_encoder", "unet"}


def test_component_too_large_for_balanced_names_itself(tiny_folders):
    with pytest.raises(pipemap.DoesNotFitError) as err:
        pipemap.plan(tiny_folders["sd"], hardware="cuda:0=3MiB,cuda:1=3MiB", headroom=0.0)
    assert err.value.component == "unet" and err.value.bytes > err.value.largest_room == 3 * 2**20
    # streamed, the unet needs only its blocks; split across both GPUs it fits too
    assert err.value.strategies == ("balanced_ultra_low_memory", "balanced_split", "auto")


@pytest.mark.slow
def test_load_takes_a_measured_headroom_as_plan_does(tiny_folders, reference_outputs):
    # both verbs build the same api.Request: headroom="measure" plans with what a dry run measured, for load too
    folder = tiny_folders["sd"]
    pipe = pipemap.load(folder, hardware="cpu=1GiB", headroom="measure", progress=False)
    assert planned(pipe) == pipemap.plan(folder, hardware="cpu=1GiB", headroom="measure")
    assert any(n.startswith("headroom measured by a dry run") for n in planned(pipe).notes)
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)


@pytest.mark.slow  # a load and a second's wait: over 1.5 s on 2 cores
def test_a_load_and_a_dry_run_take_turns(tiny_folders):
    # accelerate's init_empty_weights swaps Module.register_parameter process-wide: a load beside a dry run could
    # build meta weights. Both take quiet.PATCHING; here a dry run's hold of it keeps a load waiting until it ends
    import threading

    from pipemap.dryrun import many
    from pipemap.quiet import PATCHING

    assert many._DRY_RUNS is PATCHING
    plan = pipemap.plan(tiny_folders["sd"], hardware="cpu=1GiB")
    loaded: list = []
    with PATCHING:  # what a dry run holds while it runs
        loading = threading.Thread(target=lambda: loaded.append(pipemap.load(tiny_folders["sd"], plan=plan,
                                                                             progress=False)))
        loading.start()
        loading.join(1.0)
        assert loading.is_alive() and not loaded
    loading.join(60)
    assert loaded and all(p.device.type == "cpu" for p in loaded[0].unet.parameters())


@pytest.mark.slow  # a dry run and a 3 s hold
def test_a_dry_run_and_a_catalog_skeleton_wait_while_a_load_patches(tiny_folders):
    # simulate's stand-in models and the catalog's skeletons are built under accelerate's init_empty_weights too:
    # while a load holds quiet.PATCHING (here the test holds it, as load_onto does) neither runs; each ends after
    # the hold (unheld, each takes well under 3 s on the tiny folder and the meta device)
    import threading
    import time

    from pipemap import catalog
    from pipemap.quiet import PATCHING

    plan = pipemap.plan(tiny_folders["sd"], hardware="cpu=1GiB")
    ended: list = []
    catalog._skeleton.cache_clear()
    jobs = [lambda: pipemap.simulate(tiny_folders["sd"], plan, advice=False),
            lambda: catalog._skeleton("stable-diffusion-1.5", "vae")]
    threads = [threading.Thread(target=lambda job=job: ended.append((job(), time.monotonic()))) for job in jobs]
    with PATCHING:
        for thread in threads:
            thread.start()
        time.sleep(3.0)
        released = time.monotonic()
    for thread in threads:
        thread.join(120)
    assert len(ended) == 2 and all(at >= released for _, at in ended)
    assert any(getattr(result, "ok", False) for result, _ in ended)


def test_load_walks_no_model_it_loaded_onto_the_cpu_and_dispatch_still_moves_one_planned_on_a_gpu(
        tiny_folders, reference_outputs, monkeypatch, fake_cuda):
    import importlib

    placing = importlib.import_module("pipemap.dispatch.placing")
    walked: list[str] = []
    place = placing.place_component
    monkeypatch.setattr(placing, "place_component", lambda module, p, moves=None: walked.append(p.component) or place(
        module, p, moves))
    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware="cuda:0=1GiB,cpu=4GiB", strategy={"unet": "cuda:0", "text_encoder": "cpu",
                                                                            "vae": "cpu"})
    pipe = pipemap.load(folder, plan=plan, progress=False)
    assert walked == ["unet"]  # the two loaded onto the CPU, where they stay whole: nothing to walk
    assert {t.device.type for m in (pipe.text_encoder, pipe.vae) for t in m.state_dict().values()} == {"cpu"}
    assert {t.device for t in pipe.unet.parameters()} == {torch.device("cuda:0")}
    torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    pipemap.reset(pipe)
    # named as loaded but planned on a GPU: dispatch places it all the same
    pipe = plain_pipeline(folder)
    walked.clear()
    placing.place(pipe, plan, loaded=frozenset({"unet", "vae"}))
    assert walked == ["text_encoder", "unet"] and {t.device for t in pipe.unet.parameters()} == {torch.device("cuda:0")}
