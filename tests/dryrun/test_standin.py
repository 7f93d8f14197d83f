"""dryrun/standin.py: stand-in weights and devices. Each planned GPU gets a stand-in ``meta:N``; a module's weights
become fake tensors of the same shapes there (ties kept, the original untouched, nothing read from a folder); one
operation on two stand-ins raises as two GPUs would, embeddings included; attention is modelled as a fused kernel."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import families
import pipemap
from helpers import plain_pipeline
from pipemap import Component, Hardware, Inventory
from pipemap.dryrun import standin
from pipemap.dryrun.trackers import StorageTracker


@pytest.fixture
def mode():
    return FakeTensorMode(allow_non_fake_inputs=True)


def _plan(strategy: dict, hardware: str):
    parts = tuple(Component(name, "diffusers", "Model", size, True)
                  for name, size in (("unet", 3000), ("vae", 2000), ("text_encoder", 100)))
    return pipemap.plan(Inventory("test", "TestPipeline", parts), hardware=Hardware.parse(hardware),
                        strategy=strategy, headroom=0.0)


def test_devices_for_maps_each_planned_gpu_to_its_stand_in_and_keeps_the_cpu():
    plan = _plan({"unet": "cuda:0", "vae": "cuda:2", "text_encoder": "cpu"}, "cuda:0=3500,cuda:2=3500,cpu=1GiB")
    assert standin.devices_for(plan) == {"cuda:0": "meta:0", "cuda:2": "meta:2", "cpu": "cpu"}
    remapped = plan.remap(standin.devices_for(plan))
    assert remapped.device_map == {"unet": "meta:0", "vae": "meta:2", "text_encoder": "cpu"}


def test_fake_module_makes_fakes_of_the_same_shapes_on_the_stand_in_and_leaves_the_original(mode):
    real = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False), torch.nn.LayerNorm(10))
    real[1].weight = real[0].weight  # tied, as a language model's head and embedding
    table = torch.arange(100.0)
    real.register_buffer("window", table[10:20])  # a view into a larger storage
    before = {name: t.clone() for name, t in real.state_dict().items()}
    fake = standin.fake_module(real, mode, "meta:1")
    for (name, r), (_, f) in zip(real.state_dict(keep_vars=True).items(), fake.state_dict(keep_vars=True).items()):
        assert isinstance(f, FakeTensor) and str(f.device) == "meta:1", name
        parameter = isinstance(r, torch.nn.Parameter)
        assert (f.shape, f.dtype, isinstance(f, torch.nn.Parameter)) == (r.shape, r.dtype, parameter), name
    assert fake[1].weight is fake[0].weight  # the tie holds: counted once
    assert fake.window.untyped_storage().nbytes() == 10 * 4  # as .to(device) copies a view: its elements only
    # the original is as it was: real tensors, on the CPU, with their values
    assert not any(isinstance(t, FakeTensor) for t in real.state_dict().values())
    assert real[1].weight is real[0].weight and real.window.untyped_storage().nbytes() == 100 * 4
    for name, value in real.state_dict().items():
        assert torch.equal(value, before[name]), name
    with mode:  # and the copy runs, on its stand-in
        out = fake(torch.tensor([1, 2, 3]))
    assert out.shape == (3, 10) and str(out.device) == "meta:1"


def test_fill_fakes_casts_to_the_dtype_and_keeps_named_modules_in_fp32(mode):
    module = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "norm": torch.nn.LayerNorm(4)})
    module.register_buffer("steps", torch.arange(3))
    standin.fill_fakes(module, mode, "meta:0", torch.float16, ("norm",))
    assert {module.proj.weight.dtype, module.proj.bias.dtype} == {torch.float16}
    assert {module.norm.weight.dtype, module.norm.bias.dtype} == {torch.float32}
    assert module.steps.dtype == torch.int64  # integers stay integers
    assert all(isinstance(t, FakeTensor) and str(t.device) == "meta:0" for t in module.state_dict().values())


def test_a_folder_becomes_a_pipeline_of_fakes_on_each_components_stand_in(tiny_folders, mode):
    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware="2x5MiB,cpu=1GiB", strategy={"unet": "cuda:0", "vae": "cuda:1",
                                                                      "text_encoder": "cpu"}, headroom=0.0)
    device_of = {"unet": "meta:0", "vae": "meta:1", "text_encoder": "cpu"}
    fake = standin.pipeline_from_folder(folder, plan, mode, device_of)
    real = plain_pipeline(folder)
    for name, device in device_of.items():
        fakes, reals = getattr(fake, name).state_dict(), getattr(real, name).state_dict()
        assert {k: (v.shape, v.dtype) for k, v in fakes.items()} == {k: (v.shape, v.dtype) for k, v in reals.items()}
        assert all(isinstance(v, FakeTensor) and str(v.device) == device for v in fakes.values()), name
    assert type(fake.tokenizer) is type(real.tokenizer) and type(fake.scheduler) is type(real.scheduler)


def test_strict_devices_raises_a_device_mix_error_on_two_stand_ins(mode):
    with mode:
        a, b = torch.empty(4, device="meta:0"), torch.empty(4, device="meta:1")
    with mode, standin.StrictDevices(), pytest.raises(standin.DeviceMixError) as mixed:
        a + b
    assert mixed.value.operation == "aten.add.Tensor" and mixed.value.devices == ("meta:0", "meta:1")
    assert isinstance(mixed.value, pipemap.PipemapError) and "got tensors on meta:0, meta:1" in str(mixed.value)
    with mode, standin.StrictDevices(), pytest.raises(standin.DeviceMixError):
        a + torch.ones(4)  # a CPU tensor with elements is a mix too, as on a GPU


def test_strict_devices_catches_an_embedding_that_fake_mode_alone_lets_through(mode):
    with mode:
        ids = torch.zeros(3, dtype=torch.long, device="meta:0")
        table = torch.empty(10, 4, device="meta:1")
        assert str(F.embedding(ids, table).device) == "meta:1"  # fake mode alone: no complaint
    with mode, standin.StrictDevices(), pytest.raises(standin.DeviceMixError) as mixed:
        F.embedding(ids, table)
    assert mixed.value.operation == "aten.embedding.default"


def test_strict_devices_allows_what_a_gpu_allows(mode):
    with mode:
        a, table = torch.empty(4, device="meta:0"), torch.empty(10, 4, device="meta:1")
    with mode, standin.StrictDevices():
        assert str((a * torch.tensor(2.0)).device) == "meta:0"  # a 0-dim CPU scalar
        assert str(a.to("meta:1").device) == "meta:1"  # a copy between devices
        assert table[torch.tensor([1, 2])].shape == (2, 4)  # CPU index tensors


@pytest.mark.parametrize("fused", [False, True])
def test_fused_attention_returns_the_output_without_the_score_matrix(mode, fused):
    with mode:
        q = torch.empty(1, 8, 1024, 64, device="meta:0")
    tracker = StorageTracker()
    with standin.fused_attention() if fused else contextlib.nullcontext(), mode, tracker:
        out = F.scaled_dot_product_attention(q, q, q)
    assert out.shape == q.shape and str(out.device) == "meta:0"
    scores = 8 * 1024 * 1024 * 4  # one fp32 score matrix per head
    if fused:
        assert tracker.peak["meta:0"] < q.numel() * 4 + scores // 10
    else:
        assert tracker.peak["meta:0"] > scores  # the math path the meta device decomposes to
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


@pytest.mark.slow
def test_hunyuan_dit_from_a_folder_places_and_peaks_as_the_loaded_pipeline(tmp_path):
    # two causes of issue 17's meta/meta:1 mix, both fixed: from_pretrained loaded text_encoder_2 (an __init__
    # argument with a default, not an optional component) from disk in place of the one passed in, and
    # init_empty_weights untied T5's shared embedding from its encoder's (counted twice)
    built, call = families.build("hunyuan_dit")
    built.save_pretrained(tmp_path)
    pipe = plain_pipeline(str(tmp_path))  # loaded, not as built: BertModel loads with the pooler built without
    plan = pipemap.plan(str(tmp_path), hardware="2x8MiB,cpu=1GiB", headroom=0.0,
                        strategy={"text_encoder_2": "cuda:1", "transformer": "cuda:0", "vae": "cuda:0",
                                  "text_encoder": "cuda:0"})
    from_folder = pipemap.simulate(str(tmp_path), plan, **families.fresh(call))
    from_pipe = pipemap.simulate(pipe, plan, **families.fresh(call))
    assert from_folder.ok and from_pipe.ok, (from_folder.error, from_pipe.error)
    assert from_folder.peak_bytes == from_pipe.peak_bytes
    assert from_folder.weight_bytes == from_pipe.weight_bytes
    assert from_folder.peak_phase == from_pipe.peak_phase
    t5 = pipe.text_encoder_2
    assert from_pipe.weight_bytes["cuda:1"] == sum(p.numel() * p.element_size() for p in t5.parameters())
