"""runtime/guard: a placed pipeline's class swap, on a small pipeline-like class (the diffusers pipelines' own are in
tests/test_dispatch.py, tests/test_everyday_changes.py and tests/dispatch/test_parallel.py)."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

import pipemap
from pipemap.dispatch.guard import Around, guard, unguard, unguarded_class
from pipemap.hooks import resident
from pipemap.plan import DeviceUse, Placement, Plan
from pipemap.runtime.placed import mark, placed, unmark

PLAN = Plan("balanced", (Placement("unet", "cpu", 30),), (DeviceUse("cpu", 100, 100, 30),), "cpu")


class Toy:
    """What the guard needs of a pipeline: a call whose state lives on the object, a method that changes its models
    (a name diffusers' loader mixins use), ``to``."""

    def __init__(self):
        self.unet = torch.nn.Linear(2, 2)
        self.seen: list = []

    def __call__(self, x):
        record = placed(self)
        taken = None if record is None else threading.Thread(target=lambda: self.seen.append(
            record.lock.acquire(blocking=False)))
        if taken is not None:
            taken.start()
            taken.join()
        return x

    def load_lora_weights(self):
        return resident.epoch()

    def to(self, device):
        return self


class Asked:
    """An ``Around`` that writes down what the guarded class asked of it."""

    def __init__(self):
        self.log: list = []
        self.around = Around(follow=lambda pipe: self.log.append(("follow", pipe)),
                             replace=lambda pipe, name, value: self.log.append(("replace", pipe, name, value)),
                             reset=lambda pipe: self.log.append(("reset", pipe)))


def guarded() -> tuple[Toy, Asked]:
    pipe, asked = Toy(), Asked()
    mark(pipe, PLAN)
    guard(pipe, asked.around)
    return pipe, asked


def test_the_guarded_class_keeps_its_name_and_is_made_once_per_class():
    pipe, asked = guarded()
    assert isinstance(pipe, Toy) and type(pipe) is not Toy and unguarded_class(pipe) is Toy
    assert (type(pipe).__name__, type(pipe).__qualname__, type(pipe).__module__) == (
        "Toy", Toy.__qualname__, Toy.__module__)
    other = Toy()
    mark(other, PLAN)
    guard(other, asked.around)
    assert type(other) is type(pipe)


def test_a_call_follows_first_and_holds_the_lock_another_thread_waits_on():
    pipe, asked = guarded()
    assert pipe(3) == 3
    assert asked.log == [("follow", pipe)] and pipe.seen == [False]  # another thread could not take the lock
    assert placed(pipe).lock.acquire(blocking=False)  # free again after the call


def test_a_method_that_changes_models_moves_the_change_counter_around_it():
    pipe, _ = guarded()
    before = resident.epoch()
    inside = pipe.load_lora_weights()
    assert before < inside < resident.epoch()  # marked before and after: peft's own changes need no torch hook


def test_a_placed_component_assigned_is_replaced_anything_else_set():
    pipe, asked = guarded()
    other = torch.nn.Linear(2, 2)
    pipe.unet = other
    assert asked.log == [("replace", pipe, "unet", other)] and pipe.unet is not other  # the replacer's job
    pipe.unet = pipe.unet  # the same model: set as usual
    pipe.scale = 2.0
    assert len(asked.log) == 1 and pipe.scale == 2.0


def test_what_would_undo_the_placement_is_refused_and_diffusers_undo_resets():
    pipe, asked = guarded()
    for refused in (lambda: pipe.to("cpu"), lambda: copy.deepcopy(pipe), lambda: pickle.dumps(pipe)):
        with pytest.raises(pipemap.PipelineMappedError):
            refused()
    pipe.remove_all_hooks()
    pipe.reset_device_map()
    assert asked.log == [("reset", pipe), ("reset", pipe)]


def test_unguard_gives_the_class_and_the_methods_back():
    pipe, asked = guarded()
    unguard(pipe)
    unmark(pipe)
    assert type(pipe) is Toy and pipe.to("cpu") is pipe and set(vars(pipe)) == {"unet", "seen"}
    assert pipe(1) == 1 and asked.log == [] and pipe.seen == []


def test_an_unplaced_object_of_the_guarded_class_runs_plainly():
    pipe, asked = guarded()
    fresh = type(pipe)()  # a new pipeline of the class that no dispatch marked
    assert fresh(2) == 2 and asked.log == [] and fresh.seen == []
    fresh.unet = torch.nn.Linear(1, 1)
    assert asked.log == []
