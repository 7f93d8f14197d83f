"""Start-up and the command line's surface: what ``import pipemap`` pulls in, which modules import which, and what
``--help``, ``catalog`` and ``tiny save`` say. No timings here (they are in bench/cpu.py): imports are checked by
the modules a fresh process ends up with."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pipemap
from pipemap import tiny
from pipemap.cli import STRATEGY_NAMES, TINY_KINDS, main
from pipemap.planner import AUTO, STRATEGIES

PACKAGE = Path(pipemap.__file__).parent
LOWER = ("errors", "units", "hardware", "inventory", "plan")
UPPER = ("planner", "measure", "dispatch", "offload", "simulate", "loading", "cli", "demo", "catalog")


def fresh_modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_pipemap_pulls_in_no_heavy_library():
    loaded = fresh_modules("import pipemap")
    assert not {"torch", "diffusers", "transformers", "accelerate", "rich"} & loaded


def test_help_and_catalog_import_no_torch():
    assert "torch" not in fresh_modules("from pipemap.cli import _parser; _parser().format_help()")
    assert "torch" not in fresh_modules("import contextlib, io\nfrom pipemap import catalog\n"
                                        "with contextlib.redirect_stdout(io.StringIO()): catalog.run_catalog()")


def imports_of(module: str) -> set[str]:
    """The pipemap modules ``module`` imports, at the top or inside functions (not those for type checkers only)."""
    path = PACKAGE / f"{module}.py" if (PACKAGE / f"{module}.py").exists() else PACKAGE / module / "__init__.py"
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
            base = (node.module or "").split(".")[0]
            found |= {base} if base else {alias.name for alias in node.names}
    return found


def test_lower_layers_never_import_upper_ones():
    for module in LOWER:
        assert not imports_of(module) & set(UPPER), module


def test_no_import_circles():
    modules = [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"] + ["catalog"]
    graph = {m: imports_of(m) & set(modules) for m in modules}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    assert [m for m in modules if reaches(m, m, set())] == []


def test_cli_lists_match_the_library():
    assert STRATEGY_NAMES == (*STRATEGIES, AUTO)
    assert TINY_KINDS == tiny.ALL_KINDS
    help_text = subprocess.run([sys.executable, "-m", "pipemap", "plan", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert all(name in help_text.replace("\n", " ").replace("  ", "") for name in STRATEGY_NAMES)


def test_catalog_lists_the_short_names(capsys):

    assert main(["catalog"]) == 0
    out = capsys.readouterr().out
    assert "sdxl" in out and "flux-dev" in out and "sd3.5-large" in out


def test_catalog_sizes_are_recorded_as_computed():
    from pipemap import catalog

    assert catalog.recorded_sizes() == {n: {c.name: c.bytes for c in catalog.inventory(n).models}
                                        for n in catalog.names()}, "refresh with catalog.write_sizes()"


def test_tiny_save_makes_a_folder_to_try(tmp_path, capsys):
    assert main(["tiny", "save", "sd", str(tmp_path / "tiny-sd")]) == 0
    assert "pipemap plan" in capsys.readouterr().out
    plan = pipemap.plan(str(tmp_path / "tiny-sd"), hardware="2x5MiB,cpu=1GiB")
    assert set(plan.device_map) == {"text_encoder", "unet", "vae"}
    assert "[cuda:0]" in str(plan)  # a device label is printed, not swallowed as rich markup
