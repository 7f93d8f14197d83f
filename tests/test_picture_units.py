"""Pictures read at any size (issue 28): every figure in the unit its size reads in (KiB, MiB, GiB), in the plan
picture, the terminal and the home page; the dry run's timeline has a labelled memory axis and the budget's value."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

import pipemap
from pipemap import picture
from pipemap.serve.home import home_page

SVG = "{http://www.w3.org/2000/svg}"
KIB, MIB, GIB = 1024, 1024**2, 1024**3


def _groups(svg: str, cls: str) -> list:
    return [g for g in ET.fromstring(svg).iter(f"{SVG}g") if g.get("class") == cls]


def _texts(element) -> list[str]:
    return ["".join(t.itertext()) for t in element.iter(f"{SVG}text")]


@pytest.fixture(scope="module")
def small_plan(tiny_folders):
    # the tiny SD pipeline: a few MiB of models, links of KiB
    return pipemap.plan(tiny_folders["sd"], hardware="2x8MiB,cpu=1GiB", strategy="balanced_low_memory",
                        headroom=0.0)


def test_plan_picture_writes_small_sizes_in_small_units(small_plan):
    svg = small_plan.picture(moved={"unet": 5 * KIB}).svg()
    texts = " ".join(_texts(ET.fromstring(svg)))
    assert "0.00 GiB" not in texts
    assert re.search(r"\d+\.\d\d MiB", texts)
    text = small_plan.picture().text()
    assert "0.00 GiB" not in text and "MiB" in text


def test_home_page_writes_small_sizes_in_small_units(small_plan):
    page = home_page(small_plan, "tiny sd")
    assert "0.00 GiB" not in page and "MiB" in page
    assert 'show("moved", "pipemap_bytes_moved_total", 0, bytes)' in page  # bytes moved shown in units too


@pytest.mark.parametrize(("top", "unit", "ticks"), [
    (40 * KIB, "KiB", [0, 10, 20, 30, 40]),
    (int(14.4 * GIB), "GiB", [0, 5, 10]),
    (3 * MIB + 5, "MiB", [0, 1, 2, 3]),
    (900, "B", [0, 250, 500, 750]),
])
def test_memory_axis_ticks_are_round_in_the_unit_of_the_top(top, unit, ticks):
    size = {"KiB": KIB, "MiB": MIB, "GiB": GIB, "B": 1}[unit]
    assert picture.memory_ticks(top) == [t * size for t in ticks]


def test_timeline_has_a_labelled_memory_axis_and_the_budget_value():
    samples = [picture.Sample(i, "cuda:0", b * KIB, phase) for i, (b, phase) in
               enumerate([(10, "encode prompt"), (30, "denoise step 1"), (25, "denoise step 2"), (40, "vae decode")])]
    svg = picture.timeline_svg(samples, {"cuda:0": 35 * KIB}, "dry run")
    (axis,) = _groups(svg, "axis")
    assert axis.get("data-unit") == "KiB" and "memory in use (KiB)" in _texts(axis)
    ticks = _groups(svg, "tick")
    assert [int(t.get("data-bytes")) for t in ticks] == [0, 10 * KIB, 20 * KIB, 30 * KIB, 40 * KIB]
    assert [_texts(t)[0] for t in ticks] == ["0 KiB", "10 KiB", "20 KiB", "30 KiB", "40 KiB"]
    (budget,) = _groups(svg, "budget")
    assert int(budget.get("data-bytes")) == 35 * KIB and _texts(budget) == ["budget 35.00 KiB"]
    (panel,) = _groups(svg, "timeline")
    assert "peak 40.00 KiB" in _texts(panel)
