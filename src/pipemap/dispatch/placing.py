"""``dispatch``: a plan applied to a pipeline in memory, atomically: checked first, each component's tensors moved
and its hook attached; a failure at any tensor puts every one back and names the component."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CannotTravelError, DispatchError
from ..hooks import give_back_kept, hook_maker
from ..hooks.resident import quiet
from ..plan import Plan, with_ranks
from ..runtime.placed import planned
from ..runtime.streams import Queues, queues_for
from ..runtime.transfer import ensure_safe_transfers, plan_devices, synchronize
from .checks import check_pipeline, check_plan
from .following import attach, place_copy, take_over
from .moves import Move, place_component
from .resetting import copies_of, owners, reset, undo


def dispatch(pipe, plan: Plan, *, check_transfers: bool = True, ranks: str | None = None) -> None:
    """Place and hook every component of ``pipe`` as ``plan`` says; the pipeline's own call then runs unchanged.

    When the plan spans two GPUs or more, copies between them are checked first (``pipemap.check_transfers``,
    cached) and a pair that corrupts data is staged through CPU memory; ``check_transfers=False`` skips that.
    ``ranks`` (as ``pipemap.plan`` takes it: ``"auto"``, ``"process"``, ``"thread"``, ``"ray"``) overrides what the
    plan says runs its split's other ranks (``plan.ranks``).

    >>> pipe = DiffusionPipeline.from_pretrained("path/to/sdxl")                  # doctest: +SKIP
    >>> plan = pipemap.plan(pipe, hardware="2x24GiB")                             # doctest: +SKIP
    >>> pipemap.dispatch(pipe, plan); pipe.hf_device_map                          # doctest: +SKIP
    {'text_encoder': 'cuda:1', 'text_encoder_2': 'cuda:1', 'unet': 'cuda:0', 'vae': 'cuda:1'}

    A ``from_pipe`` copy of a placed pipeline runs on that pipeline's plan; dispatching the copy places it on
    ``plan`` instead, and with it the models it shares: the pipeline it was copied from (and its other copies)
    become copies of this one, on ``plan``. A pipeline that ``dispatch`` placed itself is refused: ``pipemap.reset``
    it first.
    """
    check_pipeline(pipe, "dispatch")
    if ranks is not None and isinstance(plan, Plan):
        plan = with_ranks(plan, ranks)
    give_back_kept()  # a plan counts what placed pipelines keep onloaded as free (``hooks.kept_bytes``): given back
    source = _copied_from(pipe)
    if source is None:
        place(pipe, plan, check_transfers=check_transfers)
    else:
        _replace_family(pipe, source, plan, check_transfers)


def _copied_from(pipe):
    """The placed pipeline ``pipe`` is a ``from_pipe`` copy of (its record lists ``pipe``), or None."""
    return next((owner for owner in owners(pipe) if any(c is pipe for c in copies_of(owner))), None)


def _replace_family(pipe, source, plan: Plan, check_transfers: bool) -> None:
    """``pipe``, a copy of the placed ``source``, placed on ``plan``; ``source`` and its other copies made copies of
    ``pipe``. Checked before anything moves; a placement that fails puts the family back on ``source``'s plan."""
    old = planned(source)
    assert old is not None
    check_plan(pipe, plan, shared=True)
    family = [source, *(c for c in copies_of(source) if c is not pipe)]
    reset(source)  # every model of the family unhooked and back on the CPU; each pipeline unmarked
    try:
        place(pipe, plan, check_transfers=check_transfers)
    except Exception:
        place(source, old, check_transfers=False)
        for each in [pipe, *family[1:]]:
            place_copy(source, each)
        raise
    for each in family:
        place_copy(pipe, each)


def place(pipe, plan: Plan, *, check_transfers: bool = True,
          queues: Callable[[torch.device], Queues] = queues_for, loaded: frozenset[str] = frozenset()) -> None:
    """``dispatch``, with ``queues`` making each device's copy queues (the dry run passes its stand-in queues), and
    ``loaded`` the models ``pipemap.load`` itself just loaded: those its plan keeps on the CPU whole are there
    already, every tensor (``from_pretrained`` loads there), so they are not walked (issue 38: load time)."""
    modules = check_plan(pipe, plan)
    if check_transfers:  # runs (cached) only when the plan spans two GPUs or more; stages corrupted pairs
        ensure_safe_transfers(plan_devices(plan))  # every GPU it copies between: execution GPUs and shards too
    with quiet():  # placing and hooking is no change of the models (``hooks.changes.unchanged``)
        _place_all(pipe, plan, modules, hook_maker(plan, queues), loaded)
    synchronize(plan_devices(plan))  # the placed weights ready for whatever stream calls first
    take_over(pipe, plan)


def _place_all(pipe, plan: Plan, modules: dict[str, torch.nn.Module], make_hook,
               loaded: frozenset[str] = frozenset()) -> None:
    moves: list[Move] = []
    for placement in plan.components:
        module = modules[placement.component]
        try:
            if not (placement.component in loaded and placement.device == "cpu" and not placement.shards):
                place_component(module, placement, moves)  # records each move, so a failure part-way undoes it
            attach(pipe, module, make_hook(placement))
        except Exception as err:
            undo(modules.values(), moves)
            if isinstance(err, CannotTravelError):
                raise  # the user's own input (a model that cannot travel to a worker): its own typed error
            raise DispatchError(placement.component, placement.device, err) from err
