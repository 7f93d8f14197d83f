"""The plan as a value (``pipemap.plan``): JSON round trips, ``remap``, ``device_map``, ``placement`` and the printed
table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import inventory, plan
from pipemap import DeviceUse, Hardware, Placement, Plan
from pipemap.errors import PlanFormatError
from pipemap.plan import MODES, Candidate, _mode_text

NO_GPU_NOTE = "no GPU on this machine or in the profile: every component runs on the CPU"
# text_encoder 30, text_encoder_2 40, unet 60, vae 20 bytes (150 in all)
SDXL_LIKE = inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20))
# two GPUs of 100 bytes, CPU 1000 bytes
TWO_GPUS = "cuda:0=100,cuda:1=100,cpu=1000"
MiB = 2**20
# one plan of every mode but offload: a replicated unet, a streamed text encoder (one of its two blocks kept), a
# split vae (two blocks on cuda:0), and an auto candidate
EVERY_MODE = Plan(
    "auto",
    (Placement("unet", "cuda:0", 3 * MiB, "replicated", replicas=("cuda:1",)),
     Placement("text_encoder", "cpu", 100, "stream", "cuda:1", 64, (), (("a", 32), ("b", 32)), ("a",), 32, 1, 2),
     Placement("vae", "cuda:1", MiB, "split",
               shards=(("decoder.up.0", "cuda:0", 512), ("decoder.up.1", "cuda:0", 512)))),
    (DeviceUse("cuda:0", 8 * MiB, 7 * MiB, 3 * MiB + 1024), DeviceUse("cuda:1", 8 * MiB, 7 * MiB, 4 * MiB + 32),
     DeviceUse("cpu", 64 * MiB, 64 * MiB, 100)),
    "cuda:0", "float16", "fp16", ("auto: parallel is the fastest",),
    (Candidate("parallel", 1.5, (("cuda:0", 3 * MiB),), "", 1.2), Candidate("balanced", None, (), "does not fit")))


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; GPUs 100 + 100
@pytest.mark.parametrize("strategy", ["balanced", "sequential", {"vae": "cpu"}])
def test_json_round_trip(strategy):
    original = plan(inventory(("text_encoder", 30), ("text_encoder_2", 40), ("unet", 60), ("vae", 20),
                              dtype="float16"), TWO_GPUS, strategy=strategy)
    assert Plan.from_json(original.to_json()) == original
    assert Plan.from_json(original.to_json(indent=None)) == original


def test_json_round_trip_with_notes_and_modes():
    original = Plan("balanced", (Placement("unet", "cpu", 60, "offload", "cuda:0"), Placement("vae", "cuda:0", 20)),
                    (DeviceUse("cuda:0", 100, 90, 20), DeviceUse("cpu", 1000, 1000, 60)), "cuda:0", "bfloat16",
                    "fp16", ("a note",))
    assert Plan.from_json(original.to_json()) == original


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; GPUs 100 + 100
def test_json_keys():
    data = json.loads(plan(SDXL_LIKE, TWO_GPUS).to_json())
    assert data["strategy"] == "balanced"
    assert {k: {"budget": v["budget"], "used": v["used"]} for k, v in data["devices"].items()} == {
        "cuda:0": {"budget": 100, "used": 80}, "cuda:1": {"budget": 100, "used": 70},
        "cpu": {"budget": 1000, "used": 0}}
    assert {k: {"device": v["device"], "mode": v["mode"], "bytes": v["bytes"]}
            for k, v in data["components"].items()} == {
        "text_encoder": {"device": "cuda:1", "mode": "resident", "bytes": 30},
        "text_encoder_2": {"device": "cuda:1", "mode": "resident", "bytes": 40},
        "unet": {"device": "cuda:0", "mode": "resident", "bytes": 60},
        "vae": {"device": "cuda:0", "mode": "resident", "bytes": 20}}


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; GPUs 100 + 100
def test_str_shows_every_component_and_device():
    text = str(plan(SDXL_LIKE, TWO_GPUS))
    for name in ("text_encoder", "text_encoder_2", "unet", "vae", "cuda:0", "cuda:1", "cpu", "balanced"):
        assert name in text
    assert "tokenizer" not in text  # weightless parts are not placed


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; CPU 1000
def test_str_shows_the_notes():
    assert NO_GPU_NOTE in " ".join(str(plan(SDXL_LIKE, "cpu=1000")).split())


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; GPUs 100 + 100
def test_remap_to_the_cpu_merges_device_totals():
    remapped = plan(SDXL_LIKE, TWO_GPUS).remap({"cuda:0": "cpu", "cuda:1": "cpu"})
    assert remapped == Plan(
        strategy="balanced",
        components=(Placement("text_encoder", "cpu", 30), Placement("text_encoder_2", "cpu", 40),
                    Placement("unet", "cpu", 60), Placement("vae", "cpu", 20)),
        devices=(DeviceUse("cpu", 1200, 1200, 150),),
        execution_device="cpu",
    )


def test_remap_keeps_modes():
    original = Plan("balanced", (Placement("unet", "cpu", 60, "offload", "cuda:0"), Placement("vae", "cuda:1", 20),
                                 Placement("text_encoder", "cpu", 30, "stream", "cuda:1")),
                    (DeviceUse("cuda:0", 100, 90, 0), DeviceUse("cuda:1", 100, 90, 20),
                     DeviceUse("cpu", 1000, 1000, 90)), "cuda:0")
    remapped = original.remap({0: "meta:0", "cuda:1": "meta:1"})
    assert remapped.components == (Placement("unet", "cpu", 60, "offload", "meta:0"),
                                   Placement("vae", "meta:1", 20, "resident", "meta:1"),
                                   Placement("text_encoder", "cpu", 30, "stream", "meta:1"))
    assert remapped.devices == (DeviceUse("meta:0", 100, 90, 0), DeviceUse("meta:1", 100, 90, 20),
                                DeviceUse("cpu", 1000, 1000, 90))
    assert remapped.execution_device == "meta:0"


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


def test_every_mode_survives_the_json_round_trip():
    assert Plan.from_json(EVERY_MODE.to_json()) == EVERY_MODE
    assert Plan.from_dict(json.loads(EVERY_MODE.to_json(indent=None))) == EVERY_MODE
    data = EVERY_MODE.to_dict()
    assert data["components"]["vae"]["shards"] == {"decoder.up.0": {"device": "cuda:0", "bytes": 512},
                                                   "decoder.up.1": {"device": "cuda:0", "bytes": 512}}
    assert data["components"]["text_encoder"]["blocks"] == {"a": 32, "b": 32}
    assert data["components"]["unet"]["replicas"] == ["cuda:1"]
    assert "shards" not in data["components"]["unet"] and "blocks" not in data["components"]["vae"]
    assert data["candidates"][1] == {"strategy": "balanced", "seconds": None, "peaks": {}, "reason": "does not fit",
                                     "images_per_second": None}


def test_device_map_and_placement():
    assert EVERY_MODE.device_map == {"unet": "cuda:0", "text_encoder": "cpu", "vae": "cuda:1"}
    assert EVERY_MODE.placement("vae").mode == "split"
    with pytest.raises(KeyError):
        EVERY_MODE.placement("transformer")


def test_a_placement_runs_where_it_lives_unless_told_otherwise():
    assert Placement("vae", "cuda:1", 20).execution_device == "cuda:1"
    assert Placement("vae", "cpu", 20, "offload", "cuda:0").execution_device == "cuda:0"
    assert set(MODES) == {"resident", "offload", "stream", "split", "replicated", "guidance", "sequence",
                          "guidance_sequence"}


def test_remap_moves_shards_replicas_and_merges_the_devices():
    merged = EVERY_MODE.remap({"cuda:1": "cuda:0"})
    assert merged.placement("unet").replicas == ("cuda:0",)
    assert merged.placement("vae").shards == (("decoder.up.0", "cuda:0", 512), ("decoder.up.1", "cuda:0", 512))
    assert merged.placement("text_encoder").execution_device == "cuda:0"
    assert merged.devices == (DeviceUse("cuda:0", 16 * MiB, 14 * MiB, 7 * MiB + 1056), DeviceUse("cpu", 64 * MiB,
                                                                                                  64 * MiB, 100))
    assert EVERY_MODE.remap({}) == EVERY_MODE  # nothing named: the same plan
    assert EVERY_MODE.remap({1: "cpu"}).placement("vae").device == "cpu"  # an index names a GPU


def test_the_table_shows_each_mode_in_words():
    text = str(EVERY_MODE)
    assert "pipemap plan: strategy 'auto', execution device cuda:0, dtype float16" in text
    assert "replicated: copies on cuda:1" in text
    assert "split: 1.00 KiB on cuda:0" in text
    assert "stream: 2 blocks" in text and "level 2" in text  # the cell may wrap
    assert "[cuda:1]" in text and "4.00 MiB of 7.00 MiB" in text
    assert text.endswith("note: auto: parallel is the fastest")


# a transformer of 3 MiB on cuda:0: its guidance branches at once with cuda:1, or its tokens split over 3 GPUs
@pytest.mark.parametrize(("mode", "copies", "words"), [
    ("guidance", ("cuda:1",), "guidance: 1st branch on cuda:0, 2nd on cuda:1"),
    ("sequence", ("cuda:1", "cuda:2"), "sequence: tokens split over cuda:0, cuda:1, cuda:2"),
])
def test_guidance_and_sequence_round_trip_remap_and_say_which_gpu_runs_what(mode, copies, words):
    gpus = ("cuda:0", *copies)
    original = Plan("parallel", (Placement("transformer", "cuda:0", 3 * MiB, mode, replicas=copies),),
                    tuple(DeviceUse(d, 8 * MiB, 8 * MiB, 3 * MiB) for d in gpus) + (DeviceUse("cpu", MiB, MiB, 0),),
                    "cuda:0")
    assert Plan.from_json(original.to_json()) == original
    assert json.loads(original.to_json())["components"]["transformer"]["replicas"] == list(copies)
    assert _mode_text(original.components[0]) == words and words.split(":")[0] in str(original)
    on_cpu = original.remap(dict.fromkeys(gpus, "cpu")).placement("transformer")
    assert (on_cpu.mode, on_cpu.device, on_cpu.replicas) == (mode, "cpu", ("cpu",) * len(copies))


def test_explain_ranks_the_candidates_and_says_when_there_were_none():
    lines = EVERY_MODE.explain().splitlines()
    assert lines[1].split()[:3] == ["parallel", "1.5", "1.2"] and lines[2].split()[:3] == ["balanced", "-", "-"]
    assert "does not fit" in lines[2] and lines[-1] == "auto: parallel is the fastest"
    assert plan(SDXL_LIKE, TWO_GPUS).explain() == "strategy 'balanced' was asked for; no other plan was weighed"
    asked = plan(SDXL_LIKE, TWO_GPUS, strategy="parallel")  # what parallel did with the denoiser is said too
    assert asked.explain().splitlines() == ["strategy 'parallel' was asked for; no other plan was weighed",
                                            *[n for n in asked.notes if n.startswith("parallel: ")]]
    assert len(asked.explain().splitlines()) == 3  # the call it chose for, and what it did with the denoiser
    assert "chosen for the call 1024x1024" in asked.explain()


# sizes: text_encoder 30, text_encoder_2 40, unet 60, vae 20; GPUs 100 + 100
def test_a_plan_keeps_its_machines_speeds_through_json():
    made = plan(SDXL_LIKE, TWO_GPUS + ",gpu=h100,disk_bw=3GB")
    assert made.performance == Hardware.parse(TWO_GPUS + ",gpu=h100,disk_bw=3GB").performance
    assert made.performance != Hardware.parse(TWO_GPUS + ",gpu=4090,disk_bw=3GB").performance
    assert Plan.from_json(made.to_json()).performance == made.performance
    assert Plan.from_json(made.to_json()) == made


def test_a_plan_saved_before_plans_kept_speeds_still_loads():
    # written by main's Plan.to_json (before this field): FLUX.1-dev planned for '1x80GiB,cpu=128GiB,gpu=h100'
    text = (Path(__file__).parent / "data" / "plan_saved_before_performance.json").read_text()
    assert "performance" not in json.loads(text)
    saved = Plan.from_json(text)
    assert saved.performance is None
    assert saved.device_map["transformer"] == "cuda:0" and saved.dtype == "bfloat16"
    assert Plan.from_json(saved.to_json()) == saved


def test_saved_speeds_are_checked_and_unknown_figures_left_out():
    data = json.loads(plan(SDXL_LIKE, TWO_GPUS + ",gpu=a100").to_json())
    data["performance"]["a_later_figure"] = 1.0
    assert Plan.from_dict(data).performance == Hardware.parse(TWO_GPUS + ",gpu=a100").performance
    data["performance"]["flops"] = -1
    with pytest.raises(PlanFormatError, match="performance"):
        Plan.from_dict(data)
    data["performance"] = [1, 2]
    with pytest.raises(PlanFormatError, match="performance"):
        Plan.from_dict(data)
