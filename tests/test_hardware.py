"""Hardware profiles: parsed from text, detected, or restricted by ``max_memory``."""

from __future__ import annotations

import pytest
import torch

import pipemap
from pipemap import Device, Hardware, HardwareSpecError, PipemapError, UnknownDeviceError
from pipemap.hardware import (
    ATTENTION_SHARE,
    GENERATION,
    GPU_PERFORMANCE,
    SUSTAINED,
    attention_rate,
    gpu_key,
    moved_share,
    performance_for,
    sustained_share,
    tensor_share,
)

GiB = 1024**3


# ---- Hardware.parse ----------------------------------------------------------------------------------------------


def test_parse_full_form():
    hw = Hardware.parse("cuda:0=24GiB,cuda:1=16GiB,cpu=64GiB")
    assert hw == Hardware((Device("cuda:0", 24 * GiB), Device("cuda:1", 16 * GiB), Device("cpu", 64 * GiB)))
    assert hw.names == ("cuda:0", "cuda:1", "cpu")
    assert [d.name for d in hw.gpus] == ["cuda:0", "cuda:1"]
    assert hw.memory("cuda:1") == 16 * GiB
    assert not hw.detected


def test_parse_orders_gpus_by_index_then_cpu():
    hw = Hardware.parse("cpu=1000, cuda:10=300, cuda:2=200, cuda=100")
    assert hw.names == ("cuda:0", "cuda:2", "cuda:10", "cpu")
    assert [d.memory for d in hw.devices] == [100, 200, 300, 1000]


def test_parse_shorthand():
    assert Hardware.parse("2x24GiB,cpu=64GiB") == Hardware(
        (Device("cuda:0", 24 * GiB), Device("cuda:1", 24 * GiB), Device("cpu", 64 * GiB)))


def test_parse_shorthand_mixed_with_named_gpu():
    hw = Hardware.parse("2x24GiB,cuda:2=8GiB,cpu=64GiB")
    assert hw.devices == (Device("cuda:0", 24 * GiB), Device("cuda:1", 24 * GiB), Device("cuda:2", 8 * GiB),
                          Device("cpu", 64 * GiB))


def test_parse_shorthand_after_named_gpu_continues_the_numbering():
    hw = Hardware.parse("cuda:0=8GiB,2x24GiB,cpu=64GiB")
    assert hw.names == ("cuda:0", "cuda:1", "cuda:2", "cpu")
    assert hw.memory("cuda:0") == 8 * GiB and hw.memory("cuda:2") == 24 * GiB


def test_parse_without_cpu_gets_this_machines_ram():
    hw = Hardware.parse("cuda:0=1000")
    assert hw.names == ("cuda:0", "cpu")
    assert hw.memory("cpu") > 0


def test_parse_cpu_only():
    hw = Hardware.parse("cpu=64GiB")
    assert hw.devices == (Device("cpu", 64 * GiB),)
    assert hw.gpus == ()


def test_a_size_in_gb_is_read_as_powers_of_1000_with_a_note_of_how_it_was_read():
    import warnings

    with pytest.warns(pipemap.DecimalSizeWarning, match=r"'16GB' as 16 x 10\^9 bytes = 14.90 GiB.*16GiB") as got:
        hw = Hardware.parse("2x16GB,cpu=64GiB")
    assert [d.memory for d in hw.gpus] == [16 * 10**9] * 2
    assert len(got) == 1  # one note a size written so: "2x16GB" is one size
    with pytest.warns(pipemap.DecimalSizeWarning, match="'20GB' as 20 x 10\\^9 bytes"):
        hw.with_max_memory({0: "20GB"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # binary sizes, bytes and figures say nothing
        Hardware.parse("2x16GiB,cpu=64GiB,host_bw=25GB").with_max_memory({0: "8GiB", "cpu": 2**30})


def test_str_lists_every_device():
    assert str(Hardware.parse("2x24GiB,cpu=64GiB")) == "cuda:0=24.00 GiB,cuda:1=24.00 GiB,cpu=64.00 GiB"


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("cuda:0=24GiB,gpu0=24GiB", "gpu0=24GiB"),    # not a device name
        ("cuda:0=lots", "cuda:0=lots"),              # not a size
        ("cuda:0", "cuda:0"),                        # no size
        ("2xlots,cpu=64GiB", "2xlots"),              # shorthand with a bad size
        ("", ""),                                    # nothing at all
        (" , ", " , "),
    ],
)
def test_parse_errors_carry_spec_part_and_reason(spec, part):
    with pytest.raises(HardwareSpecError) as info:
        Hardware.parse(spec)
    err = info.value
    assert (err.spec, err.part) == (spec, part)
    assert err.reason
    assert isinstance(err, ValueError) and isinstance(err, PipemapError)
    assert "2x24GiB,cpu=64GiB" in str(err)  # the message shows the forms that work


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("cuda:0=24GiB,cuda:0=16GiB", "cuda:0=16GiB"),
        ("cuda=24GiB,cuda:0=16GiB", "cuda:0=16GiB"),  # two spellings of cuda:0
        ("cpu=1GiB,cpu:0=2GiB", "cpu:0=2GiB"),
        ("2x24GiB,cuda:1=8GiB", "cuda:1=8GiB"),      # the shorthand already made cuda:1
    ],
)
def test_parse_duplicate_device(spec, part):
    with pytest.raises(HardwareSpecError) as info:
        Hardware.parse(spec)
    assert info.value.part == part
    assert "twice" in info.value.reason


# ---- Hardware.detect ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_detect_on_a_cpu_only_machine():
    hw = Hardware.detect()
    assert hw.detected
    assert hw.names == ("cpu",)
    assert hw.gpus == ()
    assert hw.memory("cpu") > 0


def test_detect_always_ends_with_the_cpu():
    hw = Hardware.detect()
    assert hw.names[-1] == "cpu"
    assert all(name.startswith("cuda:") for name in hw.names[:-1])


# ---- with_max_memory ---------------------------------------------------------------------------------------------

TWO_GPUS = Hardware.parse("cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB")


def test_with_max_memory_diffusers_keys_and_values():
    hw = TWO_GPUS.with_max_memory({0: "20GiB", "cuda:1": 10 * GiB, "cpu": "32GiB"})
    assert hw.devices == (Device("cuda:0", 20 * GiB), Device("cuda:1", 10 * GiB), Device("cpu", 32 * GiB))


def test_with_max_memory_leaves_out_gpus_not_named_and_keeps_the_cpu():
    hw = TWO_GPUS.with_max_memory({"cuda:1": "8GiB"})
    assert hw.devices == (Device("cuda:1", 8 * GiB), Device("cpu", 64 * GiB))


def test_with_max_memory_cpu_only():
    assert TWO_GPUS.with_max_memory({"cpu": 1000}).devices == (Device("cpu", 1000),)


def test_with_max_memory_keeps_the_detected_flag():
    assert Hardware.detect().with_max_memory({"cpu": "1GiB"}).detected


def test_with_max_memory_gpu_missing_from_the_machine():
    with pytest.raises(UnknownDeviceError) as info:
        TWO_GPUS.with_max_memory({0: "20GiB", 2: "20GiB"})
    assert info.value.device == "cuda:2"
    assert info.value.available == ("cuda:0", "cuda:1", "cpu")
    assert "cuda:0, cuda:1, cpu" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_with_max_memory_gpu_on_the_detected_cpu_only_machine():
    with pytest.raises(UnknownDeviceError) as info:
        Hardware.detect().with_max_memory({0: "20GiB", "cpu": "32GiB"})
    assert info.value.device == "cuda:0"
    assert info.value.available == ("cpu",)


def test_with_max_memory_bad_size():
    with pytest.raises(ValueError):
        TWO_GPUS.with_max_memory({0: "twenty"})


def test_a_reserve_for_context_and_workspaces_comes_off_each_gpu():
    hw = Hardware.parse("2x8GiB,cpu=16GiB,reserve=512MiB")
    assert [d.memory for d in hw.devices] == [8 * 2**30 - 2**29, 8 * 2**30 - 2**29, 16 * 2**30]
    assert hw.reserve == 2**29 and Hardware.parse("2x8GiB,cpu=16GiB").reserve == 0


def test_an_unfitted_gpu_takes_its_generations_share_and_says_so():
    # the L20 has no fit of its own: the Ada generation's share, the L40S's, moved by its tensor and vector rates
    # for its FLOP/s (its memory keeps the L40S's share); the T4 (Turing, no fit in its generation) the nearest
    # fitted one's, the A100's; never another GPU's by a median
    l20, l40s = performance_for("NVIDIA L20"), performance_for("NVIDIA L40S")
    assert l20.flops / GPU_PERFORMANCE["l20"][0] == pytest.approx(moved_share(SUSTAINED["l40s"], "l20"))
    assert l20.memory_bandwidth / GPU_PERFORMANCE["l20"][1] == pytest.approx(
        l40s.memory_bandwidth / GPU_PERFORMANCE["l40s"][1])
    assert "no L20 fit" in l20.origin and "Ada" in l20.origin and "fitted on the L40S" in l40s.origin
    t4 = performance_for("Tesla T4")
    assert t4.flops == pytest.approx(GPU_PERFORMANCE["t4"][0] * moved_share(SUSTAINED["a100"], "t4"))
    assert "Turing" in t4.origin
    assert "as given" in Hardware.parse("1x16GiB,gpu=t4,flops=20T").performance.origin
    assert "generic" in performance_for("some new accelerator").origin


def test_a_share_moves_by_the_tensor_cores_peak_against_the_vector_units():
    # a FLOP's time is one at the tensor peak plus the rest of its kernel on the vector units, in the fitted GPU's
    # proportion: the H20 (148 tensor TFLOP/s beside 44 vector; the H100 989 beside 67) reaches more of its peak,
    # the H200 and H800 (the H100's rates) the H100's share; a fitted GPU keeps its own, CDNA 3 Hopper's bound
    assert tensor_share("h20")[0] == pytest.approx(1 / (1 + (1 / 0.622 - 1) * (148 / 44) / (989 / 67)), rel=1e-3)
    assert tensor_share("h200")[0] == tensor_share("h800")[0] == SUSTAINED["h100"] == tensor_share("h100")[0]
    assert tensor_share("mi300x")[0] == SUSTAINED["h100"] and "moved" in tensor_share("h20")[1]
    # FlashAttention-2's 35% of an H100 is its softmax on the vector units: 0.70 of an H20
    assert attention_rate("h20", "flash")[0] / GPU_PERFORMANCE["h20"][0] == pytest.approx(0.703, abs=1e-3)
    assert moved_share(0.5, "h100") == 0.5


def test_every_share_is_physical_and_every_gpu_has_a_generation():
    assert set(GENERATION) == set(GPU_PERFORMANCE)
    for gpu in GPU_PERFORMANCE:
        share, _origin = sustained_share(gpu)
        assert 0 < share <= 1.0 and 0 < tensor_share(gpu)[0] <= 1.0, gpu


# The GPUs people run today, each by the name its driver reports, and the table key it matches: the longest
# fragment wins ("NVIDIA H20" is no H200, an "L40" no L40S, an "L4" neither)
CURRENT_GPUS = {"NVIDIA B200": "b200", "NVIDIA H20": "h20", "NVIDIA H200": "h200", "NVIDIA GeForce RTX 5090": "5090",
                "NVIDIA L4": "l4", "NVIDIA L40": "l40", "NVIDIA L40S": "l40s", "NVIDIA A800-SXM4-80GB": "a800",
                "NVIDIA H800": "h800", "AMD Instinct MI300X": "mi300x", "AMD Instinct MI325X": "mi325x",
                "NVIDIA A10": "a10"}


@pytest.mark.parametrize("name, key", CURRENT_GPUS.items())
def test_a_current_gpu_is_known_by_its_drivers_name(name, key):
    assert gpu_key(name) == key
    figures = performance_for(name)
    assert figures.flops == pytest.approx(GPU_PERFORMANCE[key][0] * tensor_share(key)[0])
    assert key.upper() in figures.origin and figures.attention_flops is not None


def test_the_links_are_the_measured_figures_not_the_spec_sheets():
    # NVLink 4 through NCCL: ~370 GB/s one way of 450 (NVIDIA/nccl-tests#212); PCIe 5 host copies 35-53 GB/s
    # measured; PCIe 4 ~25 of 32
    h100, a100, b200 = (performance_for(gpu) for gpu in ("h100", "a100", "b200"))
    assert h100.peer_bandwidth == pytest.approx(370e9) and 35e9 <= h100.host_bandwidth <= 53e9
    assert a100.host_bandwidth == 25e9 and b200.peer_bandwidth == pytest.approx(2 * h100.peer_bandwidth)
    assert performance_for("h800").peer_bandwidth < h100.peer_bandwidth  # its NVLink is cut to 400 GB/s both ways


def test_an_unfitted_generation_says_whose_share_it_takes():
    b200, rtx, mi300x = performance_for("b200"), performance_for("RTX 5090"), performance_for("MI300X")
    assert "no Blackwell fit" in b200.origin and "fitted on the H100" in b200.origin
    assert "Ada's" in rtx.origin and "CDNA 3" in mi300x.origin
    # FlashAttention-3 is Hopper's: a Blackwell GPU runs FlashAttention-2's figure (moved to it), not FA3's 0.75
    rate, _said = attention_rate("b200", "fa3")
    assert rate == pytest.approx(GPU_PERFORMANCE["b200"][0] * moved_share(ATTENTION_SHARE["flash"][0]["hopper"],
                                                                          "b200"))


@pytest.mark.parametrize("gpu", ["b200", "h20", "5090", "l4", "a800", "mi300x"])
def test_a_current_gpu_plans_and_prices(gpu):
    # FLUX.1-dev's default call (the catalog's recorded counts: no dry run) on two of each GPU
    spec = f"2x80GiB,cpu=256GiB,gpu={gpu}"
    plan = pipemap.plan("flux.1-dev", hardware=spec, strategy="auto")
    found = pipemap.estimate("flux.1-dev", plan)
    assert found.seconds > 0 and gpu.upper() in found.speeds
