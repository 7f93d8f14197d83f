"""runtime/placed: what pipemap keeps on a placed pipeline, one record under one key, read and written only there."""

from __future__ import annotations

import dataclasses

import pytest

import pipemap
from pipemap import tiny
from pipemap.plan import DeviceUse, Placement, Plan
from pipemap.runtime.placed import KEY, Placed, admission_of, keep_admission, mark, placed, planned, replan, unmark

PLAN = Plan("balanced", (Placement("unet", "cpu", 30), Placement("vae", "cpu", 20)), (DeviceUse("cpu", 100, 100, 50),),
            "cpu")


class Pipe:
    """Anything with a ``__dict__`` holds a record; a diffusers pipeline is tested below."""


def test_a_record_is_made_replanned_and_forgotten_with_diffusers_device_map_beside_it():
    pipe = Pipe()
    assert placed(pipe) is None and planned(pipe) is None and admission_of(pipe) is None
    record = mark(pipe, PLAN)
    assert placed(pipe) is record and planned(pipe) is PLAN and pipe.hf_device_map == {"unet": "cpu", "vae": "cpu"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.plan = PLAN  # type: ignore[misc]
    copy = Pipe()
    record.copies.add(copy)
    keep_admission(pipe, "a ledger")
    moved = dataclasses.replace(PLAN, components=(Placement("unet", "cpu", 30), Placement("vae", "cuda:0", 20)))
    replan(pipe, moved)
    after = placed(pipe)
    assert after is not None and after.plan is moved and pipe.hf_device_map == {"unet": "cpu", "vae": "cuda:0"}
    # the same lock (a thread that read the old record holds the one the next call takes), copies and ledger
    assert after.lock is record.lock and list(after.copies) == [copy] and admission_of(pipe) == "a ledger"
    assert record.plan is PLAN  # the old record as it was
    unmark(pipe)
    assert vars(pipe) == {} and placed(pipe) is None


def test_replanning_with_the_same_plan_keeps_the_record():
    pipe = Pipe()
    record = mark(pipe, PLAN)
    pipe.hf_device_map = {"unet": "elsewhere"}
    replan(pipe, PLAN)
    assert placed(pipe) is record and pipe.hf_device_map == PLAN.device_map  # the device map written again


def test_a_new_mark_is_a_new_lock_and_no_copies():
    pipe = Pipe()
    first = mark(pipe, PLAN)
    first.copies.add(Pipe())
    unmark(pipe)
    second = mark(pipe, PLAN)
    assert second.lock is not first.lock and len(second.copies) == 0 and second.admission is None
    assert isinstance(second, Placed)


def test_dispatch_keeps_one_record_on_the_pipeline_and_reset_takes_it_away():
    pipe = tiny.build("sd")
    before = dict(vars(pipe))
    plan = pipemap.plan(pipe, hardware="cpu=1GiB")
    pipemap.dispatch(pipe, plan)
    assert planned(pipe) is plan and pipe.hf_device_map == plan.device_map
    assert [k for k in vars(pipe) if k.startswith("_pipemap")] == [KEY]  # no other attribute of pipemap's
    record = placed(pipe)
    assert record is not None and record.admission is None and len(record.copies) == 0
    pipemap.reset(pipe)
    assert KEY not in vars(pipe) and pipe.hf_device_map is None
    assert {k: v for k, v in vars(pipe).items() if k != "hf_device_map"} == {
        k: v for k, v in before.items() if k != "hf_device_map"}
