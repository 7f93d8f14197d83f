"""What following a placed pipeline costs at each call for published denoisers at full size, built on the meta
device (no weight allocated), against nothing (diffusers has no such step): the check each component call makes
(``hooks/changes.Seen.unchanged``: the change counter and a sum of version counters; issue 39), and the whole
signature (``hooks/changes.signature``) it takes only when one of them moved. Prints a table and appends it to
bench/RESULTS.md.

    PYTHONPATH=src python bench/follow_cost.py
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch
from accelerate import init_empty_weights

from pipemap.hooks.changes import Seen, signature

CATALOG = Path(__file__).resolve().parent.parent / "src" / "pipemap" / "catalog"
CASES = {"stable-diffusion-xl-base-1.0": ("unet", "UNet2DConditionModel"),
         "flux.1-dev": ("transformer", "FluxTransformer2DModel")}


def build(name: str, component: str, class_name: str) -> torch.nn.Module:
    import diffusers

    config = json.loads((CATALOG / f"{name}.json").read_text())["configs"][component]
    with init_empty_weights():
        return getattr(diffusers, class_name).from_config(config)


def _best(work, times: int = 5) -> float:
    taken = []
    for _ in range(times):
        start = time.perf_counter()
        work()
        taken.append(time.perf_counter() - start)
    return min(taken)


def _one_call(seen: Seen) -> None:
    """What a component call pays when nothing changed: the check at its start, the settle at its end."""
    seen.unchanged()
    seen.settle()


def main() -> None:
    lines = ["| denoiser | modules | tensors | check + settle a call (ms, best of 20) | "
             "signature on a change (ms, best of 5) |",
             "| --- | --- | --- | --- | --- |"]
    for name, (component, class_name) in CASES.items():
        model = build(name, component, class_name)
        found, seen = signature(model, state=True), Seen(model)
        check = _best(functools.partial(_one_call, seen), 20)
        assert seen.unchanged()
        whole = _best(functools.partial(signature, model, True))
        lines.append(f"| {name} {component} | {found.modules} | {found.tensors} | {check * 1e3:.2f} | "
                     f"{whole * 1e3:.1f} |")
    table = "\n".join(lines)
    print(table)
    with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as results:
        results.write(f"\n## follow_cost.py: what following costs a component call (issue 39)\n\n{table}\n")


if __name__ == "__main__":
    main()
