"""Where ``pipemap.load`` spends its CPU time, step by step, on a first load and a warm one in a fresh process.

    python bench/load_phases.py [--scale 4]     # tiny SD at that scale, saved under a scratch folder

Each step is timed (``time.process_time``) by wrapping the function that does it; the rest of ``pipemap.load`` is
what diffusers' and transformers' ``from_pretrained`` do, which plain ``DiffusionPipeline.from_pretrained`` does too.
Imports are done first, as ``bench/cpu.py``'s load section does (``import_everything``). Not a ratio: run it a few
times and read the ranges; ``bench/cpu.py --only load`` gives the comparison with diffusers.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cpu  # noqa: E402  (bench/cpu.py: the same imports and loader as the load section)

# (module, function, label): what each step of a load is
STEPS = (
    ("pipemap.inventory.folder", "check_entry", "class resolution (check_entry)"),
    ("pipemap.inventory.folder", "_weighted_component", "headers, sizes, block tree"),
    ("pipemap.api", "Request.plan", "plan"),
    ("pipemap.api", "check_weights_present", "check_weights_present"),
    ("pipemap.dispatch.loading", "load_component", "models' from_pretrained"),
    ("pipemap.dispatch.loading", "place", "place (hooks)"),
)


def timed(times: dict[str, float]) -> None:
    """Wrap each step's function so that its CPU seconds add up in ``times``."""
    for module_name, path, label in STEPS:
        owner = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        function = getattr(owner, name)

        @functools.wraps(function)
        def wrapper(*args, _function=function, _label=label, **kwargs):
            start = time.process_time()
            try:
                return _function(*args, **kwargs)
            finally:
                times[_label] = times.get(_label, 0.0) + time.process_time() - start

        setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = Path(tempfile.gettempdir()) / f"pipemap-load-phases-sd-x{args.scale}"
    if args.save:
        from pipemap import tiny

        tiny.save("sd", Path(args.save), scale=args.scale)
        return
    if not folder.exists():  # saved by another process: saving imports and resolves what a first load would
        subprocess.run([sys.executable, __file__, "--scale", str(args.scale), "--save", str(folder)], check=True)
    cpu.import_everything(folder)
    cpu.freeze_gc()
    times: dict[str, float] = {}
    timed(times)
    for run in ("first", "warm"):
        times.clear()
        start = time.process_time()
        pipe = cpu.load_with("pipemap", str(folder))
        total = time.process_time() - start
        steps = "; ".join(f"{label} {seconds * 1000:.1f}" for label, seconds in times.items())
        print(f"{run} load: {total * 1000:.1f} ms CPU; {steps}")
        del pipe
        gc.collect()


if __name__ == "__main__":
    main()
