"""Loading with a RAM budget smaller than the weights: a pipeline planned with RAM for a quarter of its weights (the
rest left in its files, read through their maps), remapped onto the CPU, gives plain diffusers' output, and the
process's peak RSS, measured in a child process, stays within the plan's figure plus a stated margin.

The child is ``bench/cpu.py --child-ram`` (the ``ram`` section of the CPU bench runs the same at 1.1 GiB): it
imports everything, resets the kernel's peak (``VmHWM``), loads, calls once, and reports the peak above the
post-import RSS. Mapped weights count in RSS once read, as RAM does; the GPU of a remapped plan is RAM too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pipemap
from pipemap import tiny

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cpu.py"
MIB = 2**20
# beyond the plan's figure, what a plain diffusers load and call of the same pipeline needs besides its weights
# (its activations and loading's own objects, measured in the same test), and this much for the hooks' own
# bookkeeping and the allocator's slack
MARGIN = 32 * MIB


def _child(loader: str, folder, plan, output) -> dict:
    done = subprocess.run([sys.executable, str(BENCH), "--child-ram", loader, str(folder), str(plan), str(output)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ram_budget_below_the_weights_holds_in_a_child_process(tmp_path):
    folder = tiny.save("sd", tmp_path / "sd", variant_fp16=False, scale=4)  # about 90 MiB of fp32 weights
    total = sum(c.bytes for c in pipemap.inspect(folder).models)
    plan = pipemap.plan(folder, hardware=f"cuda:0={total // 4},cpu={total // 4}", strategy="balanced_ultra_low_memory")
    cpu, gpu = plan.devices[-1], plan.devices[0]
    assert cpu.used <= cpu.budget < total and plan.host.disk > total // 2
    (tmp_path / "plan.json").write_text(plan.remap({"cuda:0": "cpu"}).to_json())
    ours = _child("pipemap", folder, tmp_path / "plan.json", tmp_path / "ours.npy")
    plain = _child("diffusers", folder, tmp_path / "plan.json", tmp_path / "plain.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "ours.npy"), np.load(tmp_path / "plain.npy"))
    beside_weights = plain["anon"] + plain["loaded"]
    assert ours["peak"] <= cpu.used + gpu.used + beside_weights + MARGIN, (ours, plain, cpu.used, gpu.used)
    assert ours["peak"] < plain["peak"], (ours, plain)  # plain diffusers holds every weight it read
