"""The mode table (``pipemap.modes``): every mode has every fact, code asks the table rather than the mode's string,
one rule for what a placement holds and a device's peak, and a made-up mode needs only its row and its hook."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import json
from pathlib import Path

import pytest
import torch

import pipemap
from helpers import inventory, plain_pipeline, plan, replica_inventory, run
from pipemap import cost, modes
from pipemap.dispatch import planned
from pipemap.dispatch.relief import offloaded
from pipemap.hooks import HOOKS, PlacementHook
from pipemap.hooks.moving import MovingHook
from pipemap.modes import TABLE, Mode, ModeFacts, Peak, device_use, facts, held
from pipemap.plan import DeviceUse, Placement, Plan

SRC = Path(pipemap.__file__).parent
MiB = 1 << 20
TWO_GPUS = "cuda:0=5MiB,cuda:1=5MiB,cpu=1GiB"  # the tiny pipelines: unet 3.0 MiB, vae 2.5, text encoder 0.2
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


# ---- the table -------------------------------------------------------------------------------------------------


def test_every_mode_has_a_row_and_every_row_a_mode():
    assert set(TABLE) == set(Mode) == {"resident", "offload", "stream", "split", "replicated", "guidance",
                                        "sequence", "guidance_sequence"}
    assert all(row.mode is mode for mode, row in TABLE.items())


@pytest.mark.parametrize("mode", list(Mode))
def test_each_mode_has_every_fact(mode):
    row = facts(mode)
    hook = getattr(importlib.import_module(row.hook[0]), row.hook[1])
    assert issubclass(hook, PlacementHook) and issubclass(hook, MovingHook) is row.moves_weights
    assert isinstance(row.ranks, bool) and (not row.ranks or row.copies)  # ranks run on the copies it keeps
    assert row.loads_on in ("device", "cpu")
    assert row.cost in cost.PRICING_KINDS
    assert row.label and row.pattern in ("", "hatch", "dots")
    assert isinstance(row.peak, Peak)
    assert isinstance(row.copies, bool) and isinstance(row.weightless_copy, bool)
    text = row.text(Placement("unet", "cpu", MiB, mode, replicas=("cpu",) if row.copies else (),
                              shards=(("down", "cpu", 1),) if mode == Mode.SPLIT else ()))
    assert text.startswith(str(mode))


@pytest.mark.parametrize("left_out", [f.name for f in dataclasses.fields(ModeFacts)])
def test_a_row_without_any_fact_is_refused(left_out):
    given = {f.name: getattr(facts(Mode.RESIDENT), f.name) for f in dataclasses.fields(ModeFacts) if f.name != left_out}
    with pytest.raises(TypeError, match=left_out):
        ModeFacts(**given)


def test_the_moving_modes_and_the_hooks_are_views_of_the_table():
    assert [m for m, row in TABLE.items() if row.moves_weights] == ["offload", "stream"]
    assert set(HOOKS) == set(TABLE)
    assert pipemap.Mode is Mode


def test_a_mode_is_its_plain_string_in_code_and_json():
    p = Placement("vae", "cpu", 10, "offload", "cuda:0")
    assert p.mode is Mode.OFFLOAD and p.mode == "offload" and f"{p.mode}" == "offload"
    saved = Plan("balanced", (p,), (DeviceUse("cpu", 100, 100, 10), DeviceUse("cuda:0", 100, 100, 10)), "cuda:0")
    assert json.loads(saved.to_json())["components"]["vae"]["mode"] == "offload"
    again = Plan.from_json(saved.to_json())
    assert again == saved and again.components[0].mode is Mode.OFFLOAD


# ---- at most five comparisons of a mode against a string in src/ ---------------------------------------------


def _is_mode(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "mode") or (isinstance(node, ast.Name)
                                                                         and node.id == "mode")


def _is_text(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts)
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts))


def _is_member(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Mode"


@functools.lru_cache(maxsize=1)
def _mode_comparisons() -> tuple[tuple[str, ast.Compare], ...]:
    """Every comparison in src/ with a mode on one side (``x.mode`` or ``mode``)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if "mode" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Compare) and any(_is_mode(s) for s in [node.left, *node.comparators]):
                found.append((f"{path.relative_to(SRC)}:{node.lineno}", node))
    return tuple(found)


def _comparisons(against) -> list[str]:
    return [f"{where}: {ast.unparse(node)}" for where, node in _mode_comparisons()
            if any(against(s) for s in [node.left, *node.comparators])]


def test_at_most_five_comparisons_of_a_mode_against_a_string():
    found = _comparisons(_is_text)
    assert len(found) <= 5, "\n".join(found)


def test_few_comparisons_of_a_mode_against_a_member():
    # what only one mode means (the shards of a split, how many GPUs guidance or a sequence split runs on, the plain
    # resident placements relief may move): the rest asks the table
    found = _comparisons(_is_member)
    assert len(found) <= 8, "\n".join(found)


def test_the_counter_finds_a_comparison():
    tree = ast.parse("p.mode == 'stream' or mode in ('a', 'b') or p.mode == Mode.SPLIT")
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert [any(map(_is_text, [c.left, *c.comparators])) for c in compares] == [True, True, False]


# ---- what a placement holds, a device's peak ---------------------------------------------------------------------


def test_held_counts_home_shards_and_copies():
    split = Placement("unet", "cuda:0", 100, "split", shards=(("a", "cuda:1", 30), ("b", "cuda:1", 10)))
    copied = Placement("unet", "cuda:0", 100, "replicated", replicas=("cuda:1", "cuda:2"))
    host = Placement("vae", "cpu", 50, "offload", "cuda:0", disk_bytes=20)
    assert (held(split, "cuda:0"), held(split, "cuda:1")) == (60, 40)
    assert (held(copied, "cuda:0"), held(copied, "cuda:1"), held(copied, "cuda:3")) == (100, 100, 0)
    assert (held(host, "cpu"), held(host, "cuda:0")) == (30, 0)  # in RAM less what stays in its files


def test_a_device_counts_its_largest_onload_and_its_largest_blocks_in_flight():
    placements = (Placement("unet", "cuda:0", 100),
                  Placement("a", "cpu", 40, "offload", "cuda:0"), Placement("b", "cpu", 60, "offload", "cuda:0"),
                  Placement("c", "cpu", 80, "stream", "cuda:0", room=10, resident_bytes=5),
                  Placement("d", "cpu", 80, "stream", "cuda:0", room=20, resident_bytes=7))
    assert device_use(placements, "cuda:0") == 100 + 60 + (5 + 7) + 20
    assert device_use(placements, "cpu") == 40 + 60 + 80 + 80


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_memory", "balanced_ultra_low_memory", "parallel"])
def test_the_planners_figures_are_the_one_rule(strategy):
    inv = inventory(("text_encoder", 30 * MiB), ("unet", 90 * MiB), ("vae", 40 * MiB))
    # GPUs from modes.SLACK_FROM keep an allocator pool's slack (22 MiB) off their budgets, a side pool's more
    hardware = {"balanced": "2x128MiB"}.get(strategy, "cuda:0=160MiB") + ",cpu=1GiB"
    if strategy == "parallel":  # a denoiser copied on each GPU
        inv, hardware = replica_inventory("StableDiffusionXLPipeline"), "2x16GiB,cpu=64GiB"
    made = plan(inv, hardware, strategy=strategy)
    assert strategy == "balanced" or any(p.mode != Mode.RESIDENT for p in made.components)
    for d in made.devices:
        assert d.used == device_use(made.components, d.device) + (made.staging if d.device == "cpu" else 0)


def test_with_components_moves_each_device_by_its_peak_and_keeps_a_hand_set_offset():
    base = Plan("balanced", (Placement("unet", "cuda:0", 100), Placement("vae", "cuda:0", 40)),
                (DeviceUse("cuda:0", 1000, 900, 140 + 7), DeviceUse("cpu", 1000, 900, 3)), "cuda:0")
    moved = offloaded(base, ("vae",), "note")
    assert moved.placement("vae").mode is Mode.OFFLOAD
    assert {d.device: d.used for d in moved.devices} == {"cuda:0": 100 + 40 + 7, "cpu": 3 + 40}
    assert moved.notes == ("note",)
    grown = moved.with_components(tuple(dataclasses.replace(p, bytes=p.bytes * 2) for p in moved.components))
    assert {d.device: d.used for d in grown.devices} == {"cuda:0": 200 + 80 + 7, "cpu": 3 + 80}


# ---- a made-up mode: its row and its hook, nothing else -----------------------------------------------------------


class CountingHook(PlacementHook):
    """The made-up mode's hook: a resident placement's, counting the calls it saw."""

    seen = 0

    def pre_forward(self, module, *args, **kwargs):
        type(self).seen += 1
        return super().pre_forward(module, *args, **kwargs)


MADE_UP = dataclasses.replace(facts(Mode.RESIDENT), mode="counted", hook=(__name__, "CountingHook"),
                              text=lambda p: f"counted on {p.device}")


@pytest.fixture
def counted_mode():
    modes.register(MADE_UP)
    yield MADE_UP.mode
    modes.unregister(MADE_UP.mode)
    assert "counted" not in TABLE


def test_a_made_up_mode_plans_prices_draws_saves_and_runs(tiny_folders, reference_outputs, counted_mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    base = pipemap.plan(pipe, hardware=TWO_GPUS, headroom=0.0).remap(ON_CPU)
    made = base.with_components(tuple(dataclasses.replace(p, mode=counted_mode) if p.component == "vae" else p
                                      for p in base.components))
    assert made.placement("vae").mode == "counted" and made.devices == base.devices  # held alike: same peaks
    assert "counted on cpu" in str(made) and "vae" in made.picture().svg()
    assert Plan.from_json(made.to_json()) == made
    inv = pipemap.inspect(tiny_folders["sd"])
    assert cost.predict(made, inv, made.performance) == cost.predict(base, inv, base.performance)  # priced alike
    CountingHook.seen = 0
    pipemap.dispatch(pipe, made)
    try:
        assert type(pipe.vae._hf_hook) is CountingHook
        torch.testing.assert_close(run(pipe, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
        assert CountingHook.seen > 0 and planned(pipe) == made
    finally:
        pipemap.reset(pipe)
