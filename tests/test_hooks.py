"""The hooks wing's table (``pipemap.hooks``): one hook for each placement mode, and ``hook_maker``, which gives the
hooks that move weights one ledger and one lock per dispatch."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import pipeline_state, plain_pipeline, run
from pipemap import hooks
from pipemap.hooks import HOOKS, Ledger, hook_maker, stream
from pipemap.hooks.guidance_sequence import GuidanceSequenceHook
from pipemap.modes import facts
from pipemap.plan import MODES, DeviceUse, Placement, Plan
from pipemap.runtime import streams

# one placement of each mode, all on the CPU
PLACEMENTS = {
    "resident": Placement("vae", "cpu", 20),
    "offload": Placement("text_encoder", "cpu", 30, "offload", "cpu", 40),
    "stream": Placement("unet", "cpu", 60, "stream", "cpu", 30),
    "split": Placement("transformer", "cpu", 90, "split", shards=(("blocks.1", "cpu", 45),)),
    "replicated": Placement("controlnet", "cpu", 10, "replicated", replicas=("cpu",)),
    "guidance": Placement("transformer_2", "cpu", 10, "guidance", replicas=("cpu",)),
    "sequence": Placement("image_encoder", "cpu", 10, "sequence", replicas=("cpu",)),
    "guidance_sequence": Placement("transformer_3", "cpu", 10, "guidance_sequence", replicas=("cpu",) * 3),
}
CLASSES = {"resident": hooks.PlacementHook, "offload": hooks.OffloadHook, "stream": hooks.StreamHook,
           "split": hooks.SplitHook, "replicated": hooks.ReplicaHook, "guidance": hooks.GuidanceHook,
           "sequence": hooks.SequenceHook, "guidance_sequence": GuidanceSequenceHook}
PLAN = Plan("balanced", tuple(PLACEMENTS.values()), (DeviceUse("cpu", 1000, 1000, 240),), "cpu")


def test_every_mode_has_a_hook_and_every_hook_a_mode():
    assert set(HOOKS) == set(MODES) == set(PLACEMENTS)
    assert {m for m in HOOKS if facts(m).moves_weights} == {"offload", "stream"}


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_makes_its_own_hook_from_the_placement(mode):
    placement = PLACEMENTS[mode]
    hook = HOOKS[mode](placement, "cpu", Ledger())
    assert type(hook) is CLASSES[mode] and isinstance(hook, hooks.PlacementHook)
    assert hook.component == placement.component and hook.execution_device == torch.device("cpu")
    if facts(mode).moves_weights:
        assert hook.room == placement.room


def test_hook_maker_gives_the_moving_hooks_one_ledger_and_one_lock():
    make = hook_maker(PLAN)
    made = {p.mode: make(p) for p in PLAN.components}
    offload, streamed = made["offload"], made["stream"]
    assert offload.ledger is streamed.ledger and offload.lock is streamed.lock
    locks = {id(h.lock) for mode, h in made.items() if not facts(mode).moves_weights}
    assert len(locks) == len(MODES) - 2 and id(offload.lock) not in locks  # the others each keep a lock of their own
    again = hook_maker(PLAN)(PLACEMENTS["offload"])
    assert again.ledger is not offload.ledger and again.lock is not offload.lock  # one of each per dispatch


def test_hook_maker_hands_its_queues_to_the_ledger():
    asked = []

    def queues(device):
        asked.append(str(device))
        return streams.ModelQueues(device)

    hook = hook_maker(PLAN, queues)(PLACEMENTS["stream"])
    assert asked == ["cpu"] and isinstance(hook.queues, streams.ModelQueues)


def test_hook_maker_shares_the_ledger_and_lock_of_a_moving_hook_beside():
    # a model placed after dispatch, or moved to the host on an out-of-memory error, joins the hooks already there
    placed = {p.mode: hook_maker(PLAN)(p) for p in PLAN.components}
    offload, resident = placed["offload"], placed["resident"]
    make = hook_maker(PLAN, beside=[None, torch.nn.Linear(1, 1), resident, offload])
    streamed = make(PLACEMENTS["stream"])
    assert streamed.ledger is offload.ledger and streamed.lock is offload.lock
    assert make(PLACEMENTS["resident"]).lock is not offload.lock  # a hook that moves nothing keeps its own lock
    alone = hook_maker(PLAN, beside=[resident, None])(PLACEMENTS["stream"])  # no moving hook beside: new ones
    assert alone.ledger is not offload.ledger and alone.lock is not offload.lock
    assert hooks.ledger_of(offload) is offload.ledger and hooks.ledger_of(resident) is None
    assert hooks.ledger_of(None) is None


# ---- offload and stream in one dispatch --------------------------------------------------------------------------


def test_two_gpus_offload_and_stream_mixed(tiny_folders, reference_outputs):
    pipe = plain_pipeline(tiny_folders["controlnet"])
    base = pipemap.plan(pipe, hardware="cuda:0=4MiB,cuda:1=4MiB,cpu=1GiB", strategy="balanced_low_memory",
                        headroom=0.0)
    # the vae offloaded to cuda:1, the text encoder streamed from the CPU to cuda:0 beside the unet
    te = base.placement("text_encoder")
    mixed = Plan(base.strategy, tuple(
        Placement("text_encoder", "cpu", te.bytes, "stream", "cuda:0", te.bytes) if p.component == "text_encoder"
        else p for p in base.components), base.devices, base.execution_device)
    assert {p.mode for p in mixed.components} == {"resident", "offload", "stream"}
    assert len({p.execution_device for p in mixed.components}) == 2
    run(pipe, "controlnet")  # transformers installs hooks of its own at the first call
    before = pipeline_state(pipe)
    pipemap.dispatch(pipe, mixed.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    torch.testing.assert_close(run(pipe, "controlnet"), reference_outputs["controlnet"], atol=1e-5, rtol=0)
    assert isinstance(pipe.text_encoder._hf_hook, stream.StreamHook)
    pipemap.reset(pipe)
    assert pipeline_state(pipe) == before


@pytest.mark.parametrize(("mode", "hook"), [
    ("replicated", "ReplicaHook"), ("guidance", "GuidanceHook"), ("sequence", "SequenceHook"),
    ("guidance_sequence", "GuidanceSequenceHook")])
def test_a_split_s_ranks_are_worker_processes_by_default_threads_where_asked_and_on_stand_ins(monkeypatch, mode, hook):
    from pipemap.hooks import hook_maker

    copies = ("cuda:1",) if mode != "guidance_sequence" else ("cuda:1", "cuda:2", "cuda:3")
    on_gpus = Placement("transformer", "cuda:0", 32, mode, replicas=copies)
    on_standins = Placement("transformer", "meta:0", 32, mode, replicas=tuple(f"meta:{i + 1}" for i in range(3)))

    def made(placement, ranks=None, asked=False):  # made, not attached: nothing started
        plan = Plan("parallel", (placement,), (), placement.device, ranks=ranks, ranks_asked=asked)
        made = hook_maker(plan)(placement)
        assert type(made).__name__ == hook  # one hook per mode, whatever runs its ranks
        return made.runtime, made.asked

    monkeypatch.delenv("PIPEMAP_WORKERS", raising=False)
    assert made(on_gpus) == ("process", False)  # a plan that does not say: ranks="auto", worker processes
    assert made(on_gpus, "process") == ("process", False) and made(on_gpus, "ray", True) == ("ray", True)
    assert made(on_gpus, "thread", True) == ("thread", True)
    assert made(on_standins, "process", True) == ("thread", False)  # the dry run keeps its threads
    monkeypatch.setenv("PIPEMAP_WORKERS", "thread")  # the environment's default, for a plan that does not say
    assert made(on_gpus) == ("thread", True) and made(on_gpus, "process") == ("process", False)
