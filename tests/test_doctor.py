"""``pipemap doctor``: through the real command line on a machine without a GPU, and its report for GPU pairs
played by CPU stand-ins (``cpu``, ``cpu:1``, ``cpu:2``) with a faulty copy injected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pipemap import doctor
from pipemap.runtime import transfer
from pipemap.runtime.transfer import TransferKey, TransferReport


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    transfer.clear_transfer_cache()
    yield
    transfer.clear_transfer_cache()


@pytest.mark.slow
def test_doctor_command_line_without_a_gpu(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this is the CPU-only machine wherever the test runs.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PIPEMAP_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "pipemap", "doctor"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("pipemap doctor")
    assert f"torch          {torch.__version__}" in out
    assert "no CUDA GPU found" in out and "cpu     RAM" in out
    assert "no GPU: there is no pair of GPUs, so there is nothing to check" in out
    assert "every strategy places every component on the CPU" in out


def test_run_doctor_in_process(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "_gpu_count", lambda: 0)
    assert doctor.run_doctor() == 0
    assert doctor.main_doctor(None) == 0
    out = capsys.readouterr().out
    assert out.count("pipemap doctor\n") == 2 and "NVIDIA driver" in out and "nothing to check" in out


def test_one_gpu_has_no_pair(monkeypatch):
    monkeypatch.setattr(doctor, "_gpu_count", lambda: 1)
    monkeypatch.setattr(doctor, "_gpu_line", lambda index: f"  cuda:{index}  Some GPU, 24.00 GiB free")
    text = doctor.doctor_text()
    assert "cuda:0  Some GPU" in text
    assert "one GPU: there is no pair of GPUs, so there is nothing to check" in text
    assert "offloaded to CPU RAM" in text


def test_doctor_shows_the_matrix_and_what_a_corrupted_pair_means(monkeypatch):
    def zeros_to_cpu1(tensor, source, destination):
        return torch.zeros_like(tensor) if (source, destination) == ("cpu", "cpu:1") else tensor

    # the machine's own copy corrupts (a copy= passed in would not be cached, and the cache is shown below)
    monkeypatch.setattr(transfer, "_direct_copy", zeros_to_cpu1)
    text = doctor.doctor_text(["cpu", "cpu:1", "cpu:2"])
    matrix = text.split("Copies between GPUs\n")[1].split("\n\n")[0]
    rows = [line.split("│") for line in matrix.splitlines() if line.strip().startswith("│")]
    assert [[cell.strip() for cell in row[1:-1]] for row in rows] == [
        ["cpu", "-", "corrupted", "ok"], ["cpu:1", "ok", "-", "ok"], ["cpu:2", "ok", "ok", "-"]]
    assert "cpu -> cpu:1: 24 of 24 patterns arrived wrong" in matrix
    assert "checked just now in" in matrix
    assert "corrupted for cpu -> cpu:1: pipemap stages those pairs" in text and "550.40.07" in text
    again = doctor.doctor_text(["cpu", "cpu:1", "cpu:2"])
    assert "checked from the cache" in again and "corrupted" in again


def test_meaning_of_each_status():
    key = TransferKey("535.104.05", torch.__version__, ("cuda:0", "cuda:1", "cuda:2"), ("RTX 4090",) * 3)
    pairs = {("cuda:0", "cuda:1"): "no_peer", ("cuda:1", "cuda:0"): "no_peer", ("cuda:0", "cuda:2"): "ok"}
    [line] = doctor._pair_meaning(TransferReport(pairs, key.devices, key, 0.01))
    assert line.startswith("no peer-to-peer access for cuda:0 -> cuda:1, cuda:1 -> cuda:0")
    [line] = doctor._pair_meaning(TransferReport({("cuda:0", "cuda:2"): "ok"}, key.devices, key, 0.01))
    assert line.startswith("every pair copies directly and intact")
