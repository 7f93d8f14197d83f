"""The transfer self-test and staging: a faulty copy injected for one pair is found, that pair alone is staged,
the pipeline's output stays exact, and the cache re-runs when its key changes. CPU stand-in endpoints
(``cpu``, ``cpu:1``, ``cpu:2``) play the GPUs: distinct names, all on the real CPU."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import pipemap
from helpers import plain_pipeline, run
from pipemap.runtime import transfer
from pipemap.runtime.transfer import (
    TransferReport,
    UnsafeTransferWarning,
    check_transfers,
    ensure_safe_transfers,
    move_tensor,
    stage_unsafe_pairs,
    staged_pairs,
)

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]  # cpu:0 is the plain CPU, where every real CPU tensor lives
BAD = ("cpu", "cpu:1")
TWO_GPUS = "cuda:0=5MiB,cuda:1=5MiB,cpu=1GiB"  # as in test_dispatch: tiny models fit two such GPUs


class Copies:
    """A copy function that zeroes everything sent along ``bad``, and counts its calls."""

    def __init__(self, bad: tuple[str, str] | None = BAD):
        self.bad, self.calls = bad, 0

    def __call__(self, tensor, source, destination):
        self.calls += 1
        arrived = tensor.to("cpu")
        return torch.zeros_like(arrived) if (source, destination) == self.bad else arrived


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    """A fresh disk cache, process cache and staging registry for each test."""
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    transfer.clear_transfer_cache()
    transfer.clear_staged()
    yield
    transfer.clear_transfer_cache()
    transfer.clear_staged()


@pytest.fixture
def machine(monkeypatch):
    """Make the machine's own direct copy behave as ``Copies(bad)`` (what a driver would do): unlike a ``copy=``
    passed in, its results are cached."""

    def use(bad: tuple[str, str] | None = BAD) -> Copies:
        copies = Copies(bad)
        monkeypatch.setattr(transfer, "_direct_copy", copies)
        return copies

    return use


@pytest.fixture
def staging_calls(monkeypatch) -> list[tuple[str, str]]:
    """Every (source, destination) that went through the staging path."""
    calls = []
    staged = transfer._staged_copy

    def counting(tensor, device):
        calls.append((str(tensor.device), str(device)))
        return staged(tensor, device)

    monkeypatch.setattr(transfer, "_staged_copy", counting)
    return calls


def test_faulty_pair_is_detected_and_only_it():
    report = check_transfers(DEVICES, copy=Copies())
    assert report.devices == ("cpu", "cpu:1", "cpu:2")
    assert report.pairs == {
        ("cpu", "cpu:1"): "corrupted", ("cpu", "cpu:2"): "ok",
        ("cpu:1", "cpu"): "ok", ("cpu:1", "cpu:2"): "ok",
        ("cpu:2", "cpu"): "ok", ("cpu:2", "cpu:1"): "ok",
    }
    assert report.corrupted == (BAD,) and not report.ok
    assert "24 of 24 patterns arrived wrong" in report.details[BAD]
    assert staged_pairs() == frozenset()  # checking only reports; staging is ensure_safe_transfers' job


def test_patterns_cover_dtypes_sizes_and_layouts():
    seen = []

    def recording(tensor, source, destination):
        seen.append((tensor.dtype, tensor.nbytes, tensor.is_contiguous()))
        return tensor

    check_transfers(["cpu", "cpu:1"], copy=recording)
    assert len(seen) == 2 * 24
    assert {d for d, _, _ in seen} == {torch.float32, torch.float16, torch.bfloat16, torch.int64}
    assert min(n for _, n, _ in seen) == 8 and max(n for _, n, _ in seen) > 1 << 20
    assert {c for _, _, c in seen} == {True, False}


def test_a_copy_that_fails_a_single_element_is_corrupted_and_one_that_raises_is_an_error():
    def one_off(tensor, source, destination):
        arrived = tensor.clone()
        if (source, destination) == BAD and arrived.numel() > 1000:
            arrived[-1] += 1
        return arrived

    assert check_transfers(DEVICES, copy=one_off).corrupted == (BAD,)

    def raising(tensor, source, destination):
        raise RuntimeError("peer access denied")

    report = check_transfers(["cpu:3", "cpu:4"], copy=raising)
    assert report.pairs == {("cpu:3", "cpu:4"): "error", ("cpu:4", "cpu:3"): "error"}
    assert report.errors == (("cpu:3", "cpu:4"), ("cpu:4", "cpu:3")) and report.corrupted == () and not report.ok
    assert "the copy raised RuntimeError: peer access denied" in report.details[("cpu:3", "cpu:4")]
    assert "error" in str(report)


def test_an_injected_copy_never_reaches_the_cache(machine):
    bad = check_transfers(DEVICES, copy=Copies())
    assert bad.corrupted == (BAD,) and not transfer.cache_path().exists()
    good = machine(bad=None)
    assert check_transfers(DEVICES).ok and good.calls == 6 * 24  # the machine's own copy, not the injected result
    assert check_transfers(DEVICES, copy=Copies()).corrupted == (BAD,)  # nor does an injected copy read the cache
    transfer.clear_transfer_cache()
    assert check_transfers(DEVICES).ok and check_transfers(DEVICES).cached and good.calls == 6 * 24


# plans on 2x16GiB: Wan 2.1's auto plan streams its transformer and VAE to cuda:1, where no component lives;
# Flux.1-dev split and streamed splits its transformer over both GPUs and streams its text encoders to cuda:1
@pytest.mark.parametrize(("name", "shape"), [("wan2.1-t2v-14b", "stream"), ("flux.1-dev", "split")])
def test_dispatch_checks_every_gpu_a_stream_and_split_plan_copies_between(monkeypatch, name, shape):
    import importlib

    from pipemap import catalog

    dispatch = importlib.import_module("pipemap.dispatch.placing")  # where dispatch checks the transfers
    strategy = "auto" if shape == "stream" else "balanced_split+ultra_low_memory"
    plan = pipemap.plan(catalog.inventory(name), hardware="2x16GiB", strategy=strategy)
    modes = {p.component: (p.mode, p.execution_device) for p in plan.components}
    assert ("stream", "cuda:1") in modes.values()
    if shape == "stream":
        assert "cuda:1" not in plan.device_map.values()  # only the execution GPU names it
    else:
        assert modes["transformer"][0] == "split"
    assert set(transfer.plan_devices(plan)) == {"cuda:0", "cuda:1", "cpu"}
    seen = []

    def record(devices):
        seen.append(sorted(set(devices)))
        raise KeyboardInterrupt  # stop before placing anything: the models here are stand-ins

    monkeypatch.setattr(dispatch, "ensure_safe_transfers", record)
    pipe = type("Pipe", (), {})()
    pipe.components = {name: torch.nn.Linear(1, 1) for name in plan.device_map}
    with pytest.raises(KeyboardInterrupt):
        pipemap.dispatch(pipe, plan)
    assert seen == [["cpu", "cuda:0", "cuda:1"]]


def test_ensure_stages_the_corrupted_pair_only_and_warns_once(machine):
    machine(("cpu:1", "cpu:2"))
    with pytest.warns(UnsafeTransferWarning, match=r"from cpu:1 to cpu:2 .*550\.40\.07") as caught:
        report = ensure_safe_transfers(["cpu:1", "cpu:2", "cpu"])
    assert len(caught) == 1
    assert report.devices == ("cpu:1", "cpu:2")  # the plain CPU is no peer-to-peer endpoint
    assert staged_pairs() == {("cpu:1", "cpu:2")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ensure_safe_transfers(["cpu:1", "cpu:2"])  # same pair again: cached, staged, silent


def test_ensure_skips_fewer_than_two_gpus():
    copies = Copies()
    assert ensure_safe_transfers(["cpu", "meta:0", "meta:1"], copy=copies) is None
    assert ensure_safe_transfers(["cpu:1", "cpu", "cpu:1"], copy=copies) is None
    assert copies.calls == 0


@pytest.mark.filterwarnings("ignore::pipemap.runtime.transfer.UnsafeTransferWarning")
def test_move_tensor_stages_that_pair_and_copies_the_others_directly(staging_calls):
    stage_unsafe_pairs(check_transfers(DEVICES, copy=Copies()))  # the warning is tested above
    assert staged_pairs() == {BAD}
    x = torch.arange(12.0).reshape(3, 4)[:, ::2]
    moved = move_tensor(x, torch.device("cpu:1"))
    assert staging_calls == [BAD]
    torch.testing.assert_close(moved, x, rtol=0, atol=0)
    move_tensor(x, torch.device("cpu:2"))
    assert move_tensor(x, torch.device("cpu")) is x
    assert staging_calls == [BAD]  # cpu -> cpu:2 went direct; cpu -> cpu did not move


def test_staged_copy_keeps_values_dtype_and_device():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        x = (torch.arange(10) - 5).to(dtype)
        out = transfer._staged_copy(x[::3], torch.device("cpu"))
        assert out.dtype == dtype and out.device.type == "cpu"
        assert torch.equal(out, x[::3])


@pytest.mark.slow  # over 2 s: out of the quick subset
@pytest.mark.filterwarnings("ignore::pipemap.runtime.transfer.UnsafeTransferWarning")
def test_pipeline_output_is_exact_with_a_staged_pair(tiny_folders, reference_outputs, staging_calls):
    """The unet is placed on stand-in ``cpu:1``: its weights and every input it gets go through staging."""
    ensure_safe_transfers(["cpu:1", "cpu:2"], copy=Copies(("cpu:1", "cpu:2")))
    stage_unsafe_pairs(check_transfers(DEVICES, copy=Copies()))
    assert staged_pairs() == {BAD, ("cpu:1", "cpu:2")}
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0).remap({"cuda:0": "cpu", "cuda:1": "cpu"})
    plan = dataclasses.replace(plan, components=tuple(
        dataclasses.replace(p, device="cpu:1", execution_device="cpu:1") if p.component == "unet" else p
        for p in plan.components))
    pipemap.dispatch(pipe, plan)
    try:
        output = run(pipe, "sd")
    finally:
        pipemap.reset(pipe)
    assert staging_calls and set(staging_calls) == {BAD}
    torch.testing.assert_close(output, reference_outputs["sd"], rtol=0, atol=0)


def test_second_check_is_served_from_the_process_and_disk_cache(machine):
    copies = machine()
    first = check_transfers(DEVICES)
    assert not first.cached and copies.calls == 6 * 24
    again = check_transfers(DEVICES)
    assert again.cached and again.pairs == first.pairs and copies.calls == 6 * 24
    transfer.clear_transfer_cache()  # a new process: only the disk cache is left
    from_disk = check_transfers(DEVICES)
    assert from_disk.cached and copies.calls == 6 * 24
    assert dataclasses.replace(from_disk, cached=False) == first
    fixed = machine(bad=None)
    assert check_transfers(DEVICES, refresh=True).ok
    assert fixed.calls == 6 * 24  # refresh ran it: 6 ordered pairs, 24 patterns each


def test_a_driver_update_runs_the_check_again(monkeypatch, machine):
    monkeypatch.setattr(transfer, "driver_version", lambda: "535.104.05")
    machine()
    old = check_transfers(DEVICES)
    assert old.key.driver == "535.104.05" and old.corrupted == (BAD,)
    monkeypatch.setattr(transfer, "driver_version", lambda: "550.54.14")
    copies = machine(bad=None)
    new = check_transfers(DEVICES)
    assert copies.calls == 6 * 24 and not new.cached
    assert new.key.driver == "550.54.14" and new.ok
    cache = json.loads(transfer.cache_path().read_text())
    assert sorted(entry["key"]["driver"] for entry in cache.values()) == ["535.104.05", "550.54.14"]
    monkeypatch.setattr(transfer, "driver_version", lambda: "535.104.05")
    assert check_transfers(DEVICES).cached and copies.calls == 6 * 24


def test_a_damaged_cache_file_is_ignored(tmp_path):
    transfer.cache_path().write_text("{not json")
    assert check_transfers(["cpu", "cpu:1"]).ok
    transfer.clear_transfer_cache()
    assert check_transfers(["cpu", "cpu:1"]).cached


def test_report_round_trips_and_prints():
    report = check_transfers(DEVICES, copy=Copies())
    assert TransferReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    text = str(report)
    assert "from \\ to" in text and "corrupted" in text and "cpu -> cpu:1: 24 of 24" in text
    assert str(report.key) == f"driver none | torch {torch.__version__} | cpu,cpu:1,cpu:2 | no GPU"


def test_cache_dir_defaults_to_huggingface_home(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("PIPEMAP_CACHE_DIR")
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    assert transfer.cache_path() == tmp_path / "hf" / "pipemap" / "transfers.json"


def test_endpoints_are_normalised_and_checked():
    assert [transfer.endpoint(d) for d in ("cpu:0", "CPU:2", "cuda", 1, torch.device("cuda", 3))] == [
        "cpu", "cpu:2", "cuda:0", "cuda:1", "cuda:3"]
    with pytest.raises(pipemap.UnknownDeviceError) as err:
        check_transfers(["cpu", "meta:1"])
    assert err.value.device == "meta:1"
    if not torch.cuda.is_available():
        with pytest.raises(pipemap.UnknownDeviceError):
            check_transfers(["cuda:0", "cuda:1"])
        assert check_transfers().pairs == {}  # no GPU: nothing to pair


def test_driver_version_from_proc_text():
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    open_modules = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build  (dvs)\n"
    assert transfer.parse_proc_version(proprietary) == "535.104.05"
    assert transfer.parse_proc_version(open_modules) == "550.54.14"
    assert transfer.parse_proc_version("GCC version: gcc 12.2") is None
    if not torch.cuda.is_available() and not transfer._PROC_VERSION.exists():
        assert transfer.driver_version() == "none"
