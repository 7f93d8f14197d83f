"""What following a placed pipeline costs at each call (``hooks/follow.signature``, taken before and after each
pipeline call) for published denoisers at full size, built on the meta device (no weight allocated): seconds per
signature, against nothing (diffusers has no such step). Prints a table and appends it to bench/RESULTS.md.

    PYTHONPATH=src python bench/follow_cost.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate import init_empty_weights

from pipemap.hooks.follow import signature

CATALOG = Path(__file__).resolve().parent.parent / "src" / "pipemap" / "catalog"
CASES = {"stable-diffusion-xl-base-1.0": ("unet", "UNet2DConditionModel"),
         "flux.1-dev": ("transformer", "FluxTransformer2DModel")}


def build(name: str, component: str, class_name: str) -> torch.nn.Module:
    import diffusers

    config = json.loads((CATALOG / f"{name}.json").read_text())["configs"][component]
    with init_empty_weights():
        return getattr(diffusers, class_name).from_config(config)


def main() -> None:
    lines = ["| denoiser | modules | tensors | signature (ms, best of 5) |", "| --- | --- | --- | --- |"]
    for name, (component, class_name) in CASES.items():
        model = build(name, component, class_name)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            found = signature(model)
            times.append(time.perf_counter() - start)
        lines.append(f"| {name} {component} | {len(found.state)} | {len(found.tensors)} | {min(times) * 1e3:.1f} |")
    table = "\n".join(lines)
    print(table)
    with open(Path(__file__).resolve().parent / "RESULTS.md", "a") as results:
        results.write(f"\n## follow_cost.py: a placed pipeline's models compared at each call (twice a call)\n\n"
                      f"{table}\n")


if __name__ == "__main__":
    main()
