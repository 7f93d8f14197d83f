"""``pipemap doctor`` measures the host's seconds a kernel launch (a timed stack of tiny layers on the device: the
CPU here) and stores it beside the disk speed. As the disk figure, it prices this machine only: plans for it take
it in the estimate's launch term, a spec for another machine keeps the default; ``Performance`` says which."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import pipemap
from pipemap import doctor
from pipemap.cost import compute_seconds
from pipemap.counts import Tally
from pipemap.errors import HardwareSpecError
from pipemap.hardware import (
    HOST_LAUNCH,
    KERNEL_SECONDS,
    Hardware,
    Performance,
    launch_cache_path,
    launch_default,
    performance_for,
)

FAST_HOST = 5e-6  # a host launching a kernel in 5 us, as another machine's doctor measured it: not the default


def test_doctor_stores_the_measured_launch_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    assert Hardware.detect().performance.kernel_origin == "default"  # none measured yet
    seconds = doctor.measure_kernel_seconds("cpu")
    assert 0 < seconds < 1e-2  # a kernel's dispatch: microseconds, not the loop's whole time
    stored = json.loads(launch_cache_path().read_text())
    assert stored["kernel_seconds"] == seconds
    assert stored["kernels"] == 3 * doctor.LAUNCH_LAYERS  # a linear layer, a norm, an activation: a kernel each
    assert launch_cache_path().parent == tmp_path
    assert "launches a kernel" in doctor._launch_section() and "from the cache" in doctor._launch_section()


def test_the_measured_launch_cost_prices_this_machine_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    launch_cache_path().write_text(json.dumps({"kernel_seconds": FAST_HOST}))
    this = Hardware.detect().performance
    assert (this.kernel_seconds, this.kernel_origin) == (FAST_HOST, "measured")
    assert Hardware.parse("cpu=64GiB").performance.kernel_seconds == FAST_HOST  # this machine's CPU
    for other, default in (("2x80GiB,gpu=h100", launch_default("h100")), ("cpu=64GiB,gpu=4090",
                                                                           (KERNEL_SECONDS, "default"))):
        performance = Hardware.parse(other).performance
        assert (performance.kernel_seconds, performance.kernel_origin) == default, other
    here = performance_for("h100", this_machine=True)
    assert (here.kernel_seconds, here.kernel_origin) == (FAST_HOST, "measured")
    launches = Tally(flops=1e9, kernels=10_000)  # launch-bound: the host's time is the call's
    assert compute_seconds(launches, here) == pytest.approx(10_000 * FAST_HOST)
    assert "measured by `pipemap doctor`" in here.kernel_text and "pipemap doctor" in Performance().kernel_text


def test_the_estimate_prices_launches_with_the_measured_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    spec = Hardware.parse("1x80GiB,cpu=64GiB,gpu=h100")
    plan = pipemap.plan("stable-diffusion-1.5", hardware=spec)
    default = pipemap.estimate("stable-diffusion-1.5", plan, hardware=spec)
    launch_cache_path().write_text(json.dumps({"kernel_seconds": FAST_HOST}))
    here = replace(spec, performance=performance_for("h100", this_machine=True))  # this host, an H100 in it
    fast = pipemap.estimate("stable-diffusion-1.5", plan, hardware=here)
    assert fast.seconds < default.seconds / 2  # SD 1.5 on an H100 waits for launches: 5 us a kernel, not 40
    assert "unet" in str(default) and "launch-bound" in str(default) and "default" in str(default)
    assert pipemap.estimate("stable-diffusion-1.5", plan, hardware=spec) == default  # another machine: unchanged


def test_a_bad_launch_origin_is_refused():
    with pytest.raises(HardwareSpecError):
        Performance(kernel_origin="guessed")
    with pytest.raises(HardwareSpecError):
        Performance(kernel_seconds=0.0)


def test_each_gpu_class_has_its_hosts_default_launch_cost():
    # a Hopper or Blackwell host is not the A100 host the one constant was fitted on: its class's figure, saying so
    h100, b200 = Hardware.parse("1x80GiB,gpu=h100").performance, Hardware.parse("1x180GiB,gpu=b200").performance
    assert (h100.kernel_seconds, h100.kernel_origin) == (HOST_LAUNCH["hopper"], "default_hopper")
    assert "Hopper host" in h100.kernel_text and "Blackwell" in b200.kernel_text
    assert HOST_LAUNCH["hopper"] < KERNEL_SECONDS
    a100 = Hardware.parse("1x80GiB,gpu=a100").performance
    assert (a100.kernel_seconds, a100.kernel_origin) == (KERNEL_SECONDS, "default")


@pytest.mark.parametrize("text, seconds", [("12us", 12e-6), ("0.012ms", 12e-6), ("1.2e-5s", 12e-6),
                                           ("12 µs", 12e-6), ("800ns", 8e-7)])
def test_a_spec_states_the_hosts_launch_cost(tmp_path, monkeypatch, text, seconds):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    launch_cache_path().write_text(json.dumps({"kernel_seconds": FAST_HOST}))  # stated beats measured
    performance = Hardware.parse(f"1x80GiB,gpu=h100,launch={text}").performance
    assert (performance.kernel_seconds, performance.kernel_origin) == (pytest.approx(seconds), "stated")
    assert "launch= in the hardware spec" in performance.kernel_text
    assert Hardware.parse(f"cpu=64GiB,launch={text}").performance.kernel_seconds == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["12", "fast", "-3us", "2s", "0us"])
def test_a_bad_launch_cost_is_refused_with_the_fix(text):
    with pytest.raises(HardwareSpecError, match="launch=") as err:
        Hardware.parse(f"1x80GiB,gpu=h100,launch={text}")
    assert isinstance(err.value, ValueError)


def test_a_stated_launch_cost_moves_a_launch_bound_estimate():
    # SD 1.5 on an H100 waits for its launches (the recorded counts: no dry run): 10 us a kernel is faster
    plan = pipemap.plan("stable-diffusion-1.5", hardware="1x80GiB,cpu=64GiB,gpu=h100")
    slow = pipemap.estimate("stable-diffusion-1.5", plan, hardware="1x80GiB,cpu=64GiB,gpu=h100,launch=40us")
    fast = pipemap.estimate("stable-diffusion-1.5", plan, hardware="1x80GiB,cpu=64GiB,gpu=h100,launch=10us")
    assert fast.seconds < slow.seconds / 2 and "launch=" in str(fast)
