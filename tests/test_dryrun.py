"""The dry-run wing (``pipemap.dryrun``), as the package uses it: ``pipemap.simulate`` on a tiny folder reports each
planned device's peak under the plan's own device names, and imports go one way (nothing below the wing imports
it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipemap
import pipemap.dryrun
from pipemap.dryrun import report


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_simulate_on_a_tiny_folder_reports_ok_with_a_peak_per_planned_device(tiny_folders):
    plan = pipemap.plan(tiny_folders["sd"], hardware="2x5MiB,cpu=1GiB", headroom=0.0)
    result = pipemap.simulate(tiny_folders["sd"], plan, steps=1, height=32, width=32)
    assert isinstance(result, pipemap.SimulationReport) and result.ok, result.error
    planned = {p.device for p in plan.components}
    assert {"cuda:0", "cuda:1"} <= planned <= set(result.peak_bytes)
    assert not any(device.startswith("meta") for device in result.peak_bytes)  # stand-ins are named back
    for device in planned:
        assert result.peak_bytes[device] >= result.weight_bytes[device] > 0
        assert result.peak_bytes[device] == result.weight_bytes[device] + result.activation_bytes[device]
    assert result.plan is plan and result.call["height"] == 32
    assert result.call["num_inference_steps"] == 1  # steps repeat: a few stand for all of them


def test_the_packages_report_types_are_the_wings():
    assert pipemap.SimulationReport is report.SimulationReport and pipemap.Failure is report.Failure


def _imports(path: Path, package: str) -> set[str]:
    """The absolute module names a file of ``package`` imports (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_nothing_below_the_wing_imports_it():
    root = Path(pipemap.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] == "dryrun":
            continue
        package = ".".join(("pipemap", *parts[:-1])) if parts[-1] != "__init__" else ".".join(("pipemap", *parts))
        if any(name == "pipemap.dryrun" or name.startswith("pipemap.dryrun.") for name in _imports(path, package)):
            importers.add("/".join(parts))
    # the verbs (api), the package's lazy names and the doctor (it counts a probe's kernels as the dry run counts
    # them) are above it; the planner, hooks and values are below
    assert importers <= {"api", "__init__", "doctor"}, importers
