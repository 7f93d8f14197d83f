"""Model offload and block streaming: plans, hooks on the CPU (GPU plans remapped), dry-run peaks, bytes moved."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import pipemap
from helpers import inventory, plain_pipeline, plan, problems, run
from pipemap import tiny, traffic
from pipemap.dispatch import onload_peaks
from pipemap.hooks import Ledger, hook_component, packing, stream, unhook_component
from pipemap.inventory import Component, Inventory, stream_blocks
from pipemap.plan import DeviceUse, Placement, Plan
from pipemap.planner import forcing_hardware

OFFLOADING = ("balanced_low_memory", "balanced_ultra_low_memory")
MODE = {"balanced_low_memory": "offload", "balanced_ultra_low_memory": "stream"}
DENOISERS = ("unet", "controlnet")


def _models(pipe) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _state(pipe) -> dict:
    """Everything dispatch may touch: devices, tensor identities (buffers too), hooks, instance attributes."""
    return {
        name: (sorted(module.__dict__), [(id(p), p.device, p.is_pinned()) for p in module.parameters()],
               [id(b) for b in module.buffers()], [m for m in module.modules() if hasattr(m, "_hf_hook")],
               [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in module.modules()])
        for name, module in _models(pipe).items()
    } | {"pipe": sorted(k for k in pipe.__dict__ if not k.startswith("_") or k.startswith("_pipemap")),
         "map": pipe.hf_device_map}  # a pipeline call sets _guidance_scale and the like on the pipe


def _forcing(inv: Inventory, strategy: str, gpus: int) -> str:
    """A machine at which balanced fails and ``strategy`` places something off its GPU."""
    return forcing_hardware(inv, strategy, gpus)


# ---- planning ----------------------------------------------------------------------------------------------------


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; one GPU of 200
@pytest.mark.parametrize("strategy", OFFLOADING)
def test_everything_resident_where_it_fits(strategy):
    inv = inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20))
    result = plan(inv, "cuda:0=200,cpu=1000", strategy=strategy)
    assert result == Plan(
        strategy, tuple(Placement(c.name, "cuda:0", c.bytes) for c in inv.models),
        (DeviceUse("cuda:0", 200, 200, 150), DeviceUse("cpu", 1000, 1000, 0)), "cuda:0")


# sizes: text_encoder 30 (1 call), text_encoder_2 40 (1), unet 60 (100 calls), vae 20 (1); one GPU of 110
def test_least_called_leave_the_gpu_and_the_denoiser_stays():
    inv = inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20))
    # moving te + te2 leaves unet + vae (80) and room 30 < te2 40; moving te, te2 and vae leaves unet (60) and room
    # 50 for the largest onloaded (40): the cheapest set that fits. The GPU peaks at 60 + 40 = 100.
    assert plan(inv, "cuda:0=110,cpu=1000", strategy="balanced_low_memory") == Plan(
        strategy="balanced_low_memory",
        components=(Placement("text_encoder", "cpu", 30, "offload", "cuda:0", 50),
                    Placement("text_encoder_2", "cpu", 40, "offload", "cuda:0", 50),
                    Placement("unet", "cuda:0", 60), Placement("vae", "cpu", 20, "offload", "cuda:0", 50)),
        devices=(DeviceUse("cuda:0", 110, 110, 100), DeviceUse("cpu", 1000, 1000, 90)),
        execution_device="cuda:0",
    )


# sizes: text_encoder 30, text_encoder_2 40, unet 120 (in flight 50), vae 20; one GPU of 100
def test_streaming_needs_only_the_blocks_in_flight():
    models = (Component("text_encoder", "transformers", "M", 30, True),
              Component("text_encoder_2", "transformers", "M", 40, True),
              Component("unet", "diffusers", "M", 120, True, in_flight=50),
              Component("vae", "diffusers", "M", 20, True))
    inv = Inventory("test", "TestPipeline", models)
    with pytest.raises(pipemap.DoesNotFitError) as err:
        plan(inv, "cuda:0=100,cpu=1000")
    # model offload needs the unet whole: 120 > 100; auto weighs streaming too
    assert err.value.strategies == ("balanced_ultra_low_memory", "auto")
    # streaming the unet alone leaves 90 resident and room 10 < 50; with te2 too, 50 resident and room 50
    result = plan(inv, "cuda:0=100,cpu=1000", strategy="balanced_ultra_low_memory")
    assert {p.component: (p.device, p.mode, p.execution_device, p.room) for p in result.components} == {
        "text_encoder": ("cuda:0", "resident", "cuda:0", 0), "text_encoder_2": ("cpu", "stream", "cuda:0", 40),
        "unet": ("cpu", "stream", "cuda:0", 50), "vae": ("cuda:0", "resident", "cuda:0", 0)}
    assert result.devices == (DeviceUse("cuda:0", 100, 100, 100), DeviceUse("cpu", 1000, 1000, 160))
    assert result.execution_device == "cuda:0"


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; GPUs 70 + 70
def test_two_gpus_each_offloaded_component_runs_on_the_gpu_with_most_room():
    inv = inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20))
    result = plan(inv, "cuda:0=70,cuda:1=70,cpu=1000", strategy="balanced_low_memory")
    # unet -> cuda:0 (10 left); te2 40 -> cuda:1 (30 left); te and vae offloaded, run on cuda:1 (room 30)
    assert {p.component: (p.device, p.mode, p.execution_device) for p in result.components} == {
        "text_encoder": ("cpu", "offload", "cuda:1"), "text_encoder_2": ("cuda:1", "resident", "cuda:1"),
        "unet": ("cuda:0", "resident", "cuda:0"), "vae": ("cpu", "offload", "cuda:1")}
    assert [(d.device, d.used) for d in result.devices] == [("cuda:0", 60), ("cuda:1", 70), ("cpu", 50)]


@settings(max_examples=150, deadline=None)
@given(problems())
def test_offloading_plans_stay_within_every_gpu_budget(problem):
    inv, hardware = problem
    sizes = {c.name: c.bytes for c in inv.models}
    for strategy in OFFLOADING:
        try:
            result = plan(inv, hardware, strategy=strategy)
        except pipemap.DoesNotFitError as err:
            assert err.bytes > err.largest_room and err.strategies == ()
            continue
        assert {p.component: p.bytes for p in result.components} == sizes
        for p in result.components:
            assert p.mode in ("resident", MODE[strategy])
            assert (p.device == "cpu") == (p.mode != "resident") and p.execution_device != "cpu"
        for d in result.devices[:-1]:
            resident = sum(p.bytes for p in result.components if p.device == d.device)
            moved = [p.bytes for p in result.components if p.mode != "resident" and p.execution_device == d.device]
            assert d.used == resident + max(moved, default=0) <= d.budget
        assert result.devices[-1].used == sum(p.bytes for p in result.components if p.device == "cpu")
        if all(p.mode == "resident" for p in result.components):
            assert result.components == plan(inv, hardware).components


def test_inventory_counts_calls_and_blocks_in_flight(tiny_folders):
    for folder in tiny_folders.values():
        headers = {c.name: c for c in pipemap.inspect(folder).models}
        live = {c.name: c for c in pipemap.inspect(plain_pipeline(folder)).models}
        for name, component in headers.items():
            assert component.calls_per_image == (100 if name in DENOISERS else 1)
            assert 0 < live[name].in_flight <= component.in_flight < component.bytes  # headers err high


def test_table_and_json_show_mode_execution_device_and_room():
    inv = inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20))
    result = plan(inv, "cuda:0=110,cpu=1000", strategy="balanced_low_memory")
    rows = {line.split()[1]: line for line in str(result).splitlines() if line.count("│") > 3}
    assert "offload" in rows["text_encoder"] and "cuda:0" in rows["text_encoder"] and "cpu" in rows["text_encoder"]
    assert "resident" in rows["unet"]
    data = result.to_dict()["components"]
    assert data["vae"] == {"device": "cpu", "mode": "offload", "bytes": 20, "execution_device": "cuda:0", "room": 50}
    assert Plan.from_json(result.to_json()) == result
    remapped = result.remap({"cuda:0": "cpu"})
    assert [(p.mode, p.execution_device, p.room) for p in remapped.components] == [
        ("offload", "cpu", 50), ("offload", "cpu", 50), ("resident", "cpu", 0), ("offload", "cpu", 50)]


# ---- running on the CPU: GPU plans remapped ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", OFFLOADING)
@pytest.mark.parametrize("kind", tiny.KINDS)
def test_output_equals_plain_and_reset_restores(tiny_folders, reference_outputs, kind, strategy):
    pipe = plain_pipeline(tiny_folders[kind])
    gpu_plan = pipemap.plan(pipe, hardware=_forcing(pipemap.inspect(pipe), strategy, 1), strategy=strategy,
                            headroom=0.0)
    assert {p.mode for p in gpu_plan.components} == {"resident", MODE[strategy]}
    assert all(d.used <= d.budget for d in gpu_plan.devices)
    run(pipe, kind)  # transformers installs hooks of its own at the first call
    before = _state(pipe)
    pipemap.dispatch(pipe, gpu_plan.remap({"cuda:0": "cpu"}))
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    moved = pipemap.stats(pipe)
    for p in gpu_plan.components:
        assert (moved[p.component]["h2d_bytes"] > 0) == (p.mode != "resident"), p.component
        assert moved[p.component]["d2h_bytes"] == 0 and moved[p.component]["calls"] > 0
    # in the accounting: residents plus what was onloaded at once stay within the GPU's budget (give or take the
    # non-persistent buffers, position_ids, which no header lists: 616 bytes a text encoder)
    resident = sum(p.bytes for p in gpu_plan.components if p.mode == "resident")
    assert resident + onload_peaks(pipe)["cpu"] <= gpu_plan.devices[0].budget + 4096
    pipemap.reset(pipe)
    assert _state(pipe) == before
    torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)


def test_two_gpus_offload_and_stream_mixed(tiny_folders, reference_outputs):
    pipe = plain_pipeline(tiny_folders["controlnet"])
    base = pipemap.plan(pipe, hardware="cuda:0=4MiB,cuda:1=4MiB,cpu=1GiB", strategy="balanced_low_memory",
                        headroom=0.0)
    # the vae offloaded to cuda:1, the text encoder streamed from the CPU to cuda:0 beside the unet
    te = base.placement("text_encoder")
    mixed = Plan(base.strategy, tuple(
        Placement("text_encoder", "cpu", te.bytes, "stream", "cuda:0", te.bytes) if p.component == "text_encoder"
        else p for p in base.components), base.devices, base.execution_device)
    assert {p.mode for p in mixed.components} == {"resident", "offload", "stream"}
    assert len({p.execution_device for p in mixed.components}) == 2
    run(pipe, "controlnet")  # transformers installs hooks of its own at the first call
    before = _state(pipe)
    pipemap.dispatch(pipe, mixed.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    torch.testing.assert_close(run(pipe, "controlnet"), reference_outputs["controlnet"], atol=1e-5, rtol=0)
    assert isinstance(pipe.text_encoder._hf_hook, stream.StreamHook)
    pipemap.reset(pipe)
    assert _state(pipe) == before


def test_stream_swaps_weights_block_by_block(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    unet = pipe.unet
    masters = {name: id(t) for name, t in [*unet.named_parameters(), *unet.named_buffers()]}
    blocks = stream_blocks(unet)
    assert not any(isinstance(b, (torch.nn.ModuleList, torch.nn.ModuleDict)) for _, b in blocks)
    assert "down_blocks.0" in dict(blocks) and "mid_block.attentions.0" in dict(blocks)
    seen, ledger = [], Ledger()
    hook = stream.StreamHook.for_placement(Placement("unet", "cpu", 1, "stream", "cpu", 1), "cpu", ledger)
    hook_component(unet, hook)

    def check(name, block, args):  # runs after the stream hook's own pre-hook: the block is onloaded
        tensors = [*block.named_parameters(prefix=name), *block.named_buffers(prefix=name)]
        seen.append((name, all(id(t) != masters[n] for n, t in tensors), ledger.live["cpu"]))

    for name, block in blocks:
        block.register_forward_pre_hook(lambda b, a, name=name: check(name, b, a))
    run(pipe, "sd")
    unhook_component(unet)
    assert seen and all(onloaded for _, onloaded, _ in seen)
    largest = max(packing.Group(packing.slots(b.modules()).values()).layout.nbytes for _, b in blocks)
    assert max(live for *_, live in seen) == hook.charge == 2 * largest + hook.root.layout.nbytes  # two buffers
    assert {name: id(t) for name, t in [*unet.named_parameters(), *unet.named_buffers()]} == masters
    assert ledger.live["cpu"] == 0


def test_non_persistent_buffers_travel_with_their_block():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("shift", torch.arange(4.0), persistent=False)

        def forward(self, x):
            onloaded.append(self.shift is not masters[id(self)])  # the block's copy, not the CPU master
            return self.linear(x) + self.shift

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Block(), Block())
    masters, onloaded = {id(b): b.shift for b in model[1:]}, []
    expected = model(torch.ones(2, 4))
    assert [name for name, _ in stream_blocks(model)] == ["0", "1", "2"]
    onloaded.clear()
    placement = Placement("m", "cpu", 1, "stream", "cpu", 1)
    hook_component(model, stream.StreamHook.for_placement(placement, "cpu", Ledger()))
    torch.testing.assert_close(model(torch.ones(2, 4)), expected, atol=0, rtol=0)
    assert onloaded == [True, True]
    unhook_component(model)
    assert all(b.shift is masters[id(b)] for b in model[1:])


# ---- bytes moved -------------------------------------------------------------------------------------------------


def _moved(stats) -> dict[str, int]:
    return {name: c["h2d_bytes"] + c["d2h_bytes"] for name, c in stats.items()}


def _sizes(pipe) -> dict[str, int]:
    return {n: packing.Group(packing.slots(m.modules()).values()).nbytes for n, m in _models(pipe).items()}


def test_nothing_moves_when_everything_fits(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    fits = pipemap.plan(pipe, hardware="cuda:0=1GiB,cpu=1GiB", strategy="balanced_low_memory", headroom=0.0)
    result = traffic.bytes_moved_per_image(pipe, fits.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, "sdxl"))
    assert set(_moved(result.pipemap).values()) == {0} and result.ratio == 0.0


def test_only_the_text_encoders_move_when_the_rest_fits(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    inv, sizes = pipemap.inspect(pipe), _sizes(pipe)
    rest = inv["unet"].bytes + inv["vae"].bytes + max(inv["text_encoder"].bytes, inv["text_encoder_2"].bytes)
    gpu_plan = pipemap.plan(inv, hardware=f"cuda:0={rest + 4096},cpu=1GiB", strategy="balanced_low_memory",
                            headroom=0.0)
    assert {p.component for p in gpu_plan.components if p.mode == "offload"} == {"text_encoder", "text_encoder_2"}
    result = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, "sdxl"))
    # each text encoder once per image (room for one at a time), the unet and vae never
    assert _moved(result.pipemap) == {"vae": 0, "text_encoder": sizes["text_encoder"],
                                      "text_encoder_2": sizes["text_encoder_2"], "unet": 0}
    # diffusers' model offload moves every model in and out: 2x the bytes of the pipeline per image
    assert _moved(result.diffusers) == {n: 2 * s for n, s in sizes.items()}
    assert result.ratio == pytest.approx((sizes["text_encoder"] + sizes["text_encoder_2"]) / (2 * sum(sizes.values())))
    assert result.ratio <= 1.0  # 0.039


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd", "controlnet"])
def test_text_encoder_called_twice_moves_once(tiny_folders, kind):
    pipe = plain_pipeline(tiny_folders[kind])
    inv, sizes = pipemap.inspect(pipe), _sizes(pipe)
    gpu_plan = pipemap.plan(inv, hardware=_forcing(inv, "balanced_low_memory", 1), strategy="balanced_low_memory",
                            headroom=0.0)
    # one GPU: the cheapest set that fits moves the text encoder and the vae (the denoisers stay)
    assert {p.component for p in gpu_plan.components if p.mode == "offload"} == {"text_encoder", "vae"}
    result = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, kind))
    assert result.pipemap["text_encoder"]["calls"] == 2  # the prompt and the negative prompt
    assert _moved(result.pipemap) == {n: sizes[n] if n in ("text_encoder", "vae") else 0 for n in sizes}
    assert result.ratio <= 1.0


@pytest.mark.parametrize("strategy", OFFLOADING)
@pytest.mark.parametrize("kind", tiny.KINDS)
def test_bytes_moved_at_most_diffusers_model_offload(tiny_folders, kind, strategy):
    pipe = plain_pipeline(tiny_folders[kind])
    gpu_plan = pipemap.plan(pipe, hardware=_forcing(pipemap.inspect(pipe), strategy, 1), strategy=strategy,
                            headroom=0.0)
    result = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, kind))
    assert 0 < result.ratio <= 1.0
    assert all(result.pipemap[d]["h2d_bytes"] == 0 for d in DENOISERS if d in result.pipemap)
    assert not any(hasattr(m, "_hf_hook") for m in _models(pipe).values()) and pipe.hf_device_map is None


def test_model_offload_stats_leave_the_pipeline_as_it_was(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    run(pipe, "sd")  # transformers installs hooks of its own at the first call
    before = _state(pipe)
    counts = traffic.model_offload_stats(pipe, **tiny.default_call(pipe, "sd"))
    assert counts["unet"]["calls"] == 2 and counts["text_encoder"]["calls"] == 2
    assert _moved(counts) == {n: 2 * s for n, s in _sizes(pipe).items()}
    after = _state(pipe)
    for name in _models(pipe):  # module.to() gives buffers new tensor objects: diffusers' doing, not compared
        assert after[name][:2] + after[name][3:] == before[name][:2] + before[name][3:]
    assert after["pipe"] == before["pipe"]


# ---- the dry run -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "strategy"), [("sd", "balanced_ultra_low_memory"),
                                                ("sdxl", "balanced_ultra_low_memory"),
                                                ("controlnet", "balanced_low_memory"),
                                                ("controlnet", "balanced_ultra_low_memory")])
def test_dry_run_peaks_stay_within_each_stand_in_gpu(tiny_folders, kind, strategy):
    folder = tiny_folders[kind]
    gpu_plan = pipemap.plan(folder, hardware=_forcing(pipemap.inspect(folder), strategy, 2), strategy=strategy,
                            headroom=0.0)
    assert any(p.mode == MODE[strategy] for p in gpu_plan.components)
    report = pipemap.simulate(folder, gpu_plan)
    assert report.ok, report.error
    for d in gpu_plan.devices[:-1]:
        assert d.used <= d.budget
        assert report.weight_peak_bytes[d.device] <= d.budget, (d.device, report.weight_peak_bytes)
    onloaded = {p.execution_device for p in gpu_plan.components if p.mode != "resident"}
    assert all(report.weight_peak_bytes[d] > report.weight_bytes[d] for d in onloaded)  # the onloads were measured


def test_simulate_refuses_a_pipeline_dispatched_with_offload(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    inv = pipemap.inspect(pipe)
    gpu_plan = pipemap.plan(inv, hardware=_forcing(inv, "balanced_low_memory", 1), strategy="balanced_low_memory",
                            headroom=0.0)
    pipemap.dispatch(pipe, gpu_plan.remap({"cuda:0": "cpu"}))
    with pytest.raises(pipemap.PipelineMappedError):
        pipemap.simulate(pipe, gpu_plan)
