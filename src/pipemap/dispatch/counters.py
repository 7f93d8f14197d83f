"""What a placed pipeline's hooks counted: weights moved per component (``stats``), the runtime of a split's ranks,
and the most offloaded or streamed bytes each execution device held at once (``onload_peaks``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..hooks import Moved, ledger_of, ranks_report


def stats(pipe, reset: bool = False) -> dict[str, dict[str, Any]]:
    """What each component's hook counted since dispatch: ``{component: {"calls", "h2d_bytes", "d2h_bytes"}}``;
    for a split component also what runs its other ranks and why (``"ranks"``, ``"ranks_why"``; ``"exchange"``
    where its ranks exchange through host memory; for a guidance copy its calls started ahead: ``ahead_hits``,
    ``ahead_misses``, ``ahead_held_back`` and a note where it held calls back: ``hooks.ranks_report``).

    Bytes are weights moved (inputs and outputs are not counted); ``reset=True`` zeroes the counters after reading.

    >>> plan = pipemap.plan(pipe, hardware="cuda:0=8GiB", strategy="balanced_low_memory")      # doctest: +SKIP
    >>> pipemap.dispatch(pipe, plan); pipe("a cat"); pipemap.stats(pipe)["text_encoder"]       # doctest: +SKIP
    {'calls': 2, 'h2d_bytes': 492265168, 'd2h_bytes': 0}
    """
    out = {}
    for name, module in pipe.components.items():
        hook: Any = getattr(module, "_hf_hook", None)
        if isinstance(getattr(hook, "moved", None), Moved):
            out[name] = dataclasses.asdict(hook.moved)
            if reset:
                hook.moved = Moved()
        ranks = ranks_report(hook)
        if ranks:
            out.setdefault(name, {}).update(ranks)
    return out


def onload_peaks(pipe) -> dict[str, int]:
    """The most bytes of offloaded or streamed weights each execution device held at once since dispatch."""
    for module in pipe.components.values():
        ledger = ledger_of(getattr(module, "_hf_hook", None))
        if ledger is not None:
            return dict(ledger.peak)
    return {}
