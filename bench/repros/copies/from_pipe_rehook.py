"""Three threads, each with its own ``from_pipe`` copy of one placed pipeline (``balanced_low_memory``, fake CUDA),
rounds of one call each: prints every re-hook of a shared model (``hooks.changes.rehook``, with its stack) and each
thread's distance from plain diffusers. Exits 1 while a thread fails or differs (intermittent: about 1 run in 3).

    PYTHONPATH=src:tests .venv/bin/python bench/repros/from_pipe_copies_rehook.py [ROUNDS]

What it shows (first.md): a copy's call finds a shared model changed when nothing changed it, and re-hooks it
(unhook, place, hook) while another copy's call may be entering it, which then runs unhooked.
"""

from __future__ import annotations

import sys
import threading
import traceback

from diffusers import StableDiffusionPipeline

import fakecuda
import pipemap
from everyday import images, plain, two_gpu_plan
from pipemap import tiny
from pipemap.hooks import changes


def _own_copy(pipe, want, out: dict, index: int) -> None:
    try:
        mine = StableDiffusionPipeline.from_pipe(pipe)
        mine.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        mine.set_progress_bar_config(disable=True)
        out[index] = (images(mine, "sd") - want).abs().max().item()
    except Exception as err:  # noqa: BLE001 - printed by the round
        out[index] = repr(err)[:200]


def main(rounds: int) -> int:
    original = changes.rehook

    def rehook(module, hook, placement, place):
        seen = module.__dict__.get("_pipemap_seen")
        print(f"re-hook of {type(module).__name__} on {threading.current_thread().name}: signature then "
              f"{seen._signature if seen else None}, now {changes.signature(module)}")
        print("".join(traceback.format_stack(limit=10)[:-1]))
        return original(module, hook, placement, place)

    changes.rehook = rehook
    fake = fakecuda.install(gpus=2)
    failed = 0
    try:
        pipe = tiny.build("sd")
        pipe.set_progress_bar_config(disable=True)
        pipemap.dispatch(pipe, two_gpu_plan(pipe, "balanced_low_memory"))
        want = images(plain("sd"), "sd")
        for round_ in range(rounds):
            out: dict = {}
            threads = [threading.Thread(target=_own_copy, args=(pipe, want, out, i), name=f"thread {i}")
                       for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            print(f"round {round_}: {out}")
            failed += sum(1 for v in out.values() if not isinstance(v, float) or v > 1e-5)
    finally:
        changes.rehook = original
        fake.exit()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6))
