"""Start-up and the command line's surface: what ``import pipemap`` pulls in, which modules import which, and what
``--help``, ``catalog`` and ``tiny save`` say. No timings here (they are in bench/cpu.py): imports are checked by
the modules a fresh process ends up with."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pipemap
from pipemap import tiny
from pipemap.cli import STRATEGY_NAMES, TINY_KINDS, main
from pipemap.planner import AUTO, STRATEGIES

PACKAGE = Path(pipemap.__file__).parent
ARCHITECTURE = PACKAGE.parents[1] / "ARCHITECTURE.md"


def layers_of(text: str) -> dict[str, tuple[str, ...]]:
    """``{layer: (wing, ...)}``, lowest first, from the layer table of ARCHITECTURE.md: the one statement of the
    layers (a wing is a top-level module or folder of the package; a module imports only its own layer or lower)."""
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "`" in line.split("|")[2]]
    return {layer.strip(): tuple(w.strip("`/") for w in wings.split() if w.startswith("`")) for layer, wings in rows
            if layer.strip() in ("values", "planning", "runtime", "dry run", "api", "tools")}


LAYERS = layers_of(ARCHITECTURE.read_text())
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}


def fresh_modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_pipemap_pulls_in_no_heavy_library():
    loaded = fresh_modules("import pipemap")
    assert not {"torch", "diffusers", "transformers", "accelerate", "rich"} & loaded


# what a resident plan's load and call must not import: the service, the dry run, the catalog, run_many and the
# memory ledger's relief, the hooks of other modes (and the moving code they share), rich. Not torchao nor peft:
# transformers and diffusers import those themselves in a plain from_pretrained (pipemap names neither)
NOT_FOR_A_RESIDENT_LOAD = (
    "pipemap.serve", "pipemap.dryrun", "pipemap.catalog", "pipemap.dispatch.parallel", "pipemap.dispatch.relief",
    "pipemap.dispatch.traffic", "pipemap.doctor", "pipemap.cli", "pipemap.hooks.stream", "pipemap.hooks.offload",
    "pipemap.hooks.moving",
    "pipemap.hooks.mapped", "pipemap.hooks.packing", "pipemap.hooks.split", "pipemap.hooks.replica",
    "pipemap.hooks.copies", "pipemap.hooks.guidance", "pipemap.hooks.sequence", "pipemap.hooks.exchange",
    "pipemap.hooks.workers", "pipemap.hooks.threads", "pipemap.hooks.ranks", "pipemap.hooks.guidance_sequence",
    "ray", "starlette", "uvicorn", "fastapi", "optimum", "rich", "torch.utils.flop_counter",
)

_LOAD_AND_CALL = """
import sys, torch, pipemap
pipe = pipemap.load(sys.argv[1], plan=pipemap.Plan.from_json(sys.argv[2]), progress=False)
pipe.set_progress_bar_config(disable=True)
pipe(prompt="a tiny cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
"""


@pytest.mark.slow
def test_first_load_imports_nothing_the_plan_does_not_need(tmp_path):
    folder = tiny.save("sd", tmp_path / "sd")
    plan = pipemap.plan(str(folder), hardware="cuda:0=64MiB,cpu=1GiB").remap({"cuda:0": "cpu"})
    assert {p.mode for p in plan.components} == {"resident"}
    code = f"{_LOAD_AND_CALL}\nimport json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code, str(folder), plan.to_json(indent=None)], capture_output=True,
                         text=True, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "pipemap.hooks.resident" in loaded  # it did load and hook
    assert sorted(m for m in loaded if m.startswith(NOT_FOR_A_RESIDENT_LOAD)) == []


def test_help_and_catalog_import_no_torch():
    assert "torch" not in fresh_modules("from pipemap.cli import _parser; _parser().format_help()")
    assert "torch" not in fresh_modules("import contextlib, io\nfrom pipemap import catalog\n"
                                        "with contextlib.redirect_stdout(io.StringIO()): catalog.run_catalog()")


def package_modules() -> dict[str, Path]:
    """``{dotted name below pipemap: file}`` for every module of the package (``hooks.stream``, ``api``, ...)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            found[".".join(parts)] = path
    return found


def _typing_only(tree: ast.AST) -> set[int]:
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
            and getattr(block.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(block)}


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> list[str]:
    """The pipemap modules (dotted below pipemap) a relative ``from`` import names."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1] if node.level > 1 else base
    target = ".".join([*base, *([node.module] if node.module else [])])
    if node.module:
        return [target]
    return [f"{target}.{a.name}".lstrip(".") for a in node.names]


def imports_of(module: str) -> set[str]:
    """The pipemap modules ``module`` imports, at the top or inside functions (not those for type checkers only),
    as dotted names below pipemap."""
    path = package_modules()[module]
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
            found |= set(_absolute(module, node, path.name == "__init__.py"))
    known = package_modules()
    return {name if name in known else name.rpartition(".")[0] for name in found} - {"", module}


def _wing(module: str) -> str:
    return module.split(".")[0]


def test_every_module_has_its_layer():
    assert {_wing(m) for m in package_modules()} - set(RANK) == set()


def test_the_value_layer_is_the_one_mypy_checks_strictly():
    # pyproject.toml's strict override names the value wings (a folder as ``wing.*``): no third list of layers
    text = (PACKAGE.parents[1] / "pyproject.toml").read_text()
    listed = text[text.index("[[tool.mypy.overrides]]"):].split("module = [")[1].split("]")[0]
    strict = {name.split(".")[1] for name in listed.replace('"', " ").replace(",", " ").split()}
    assert strict == set(LAYERS["values"])


def test_at_most_24_modules_at_the_top_level():
    assert len([p for p in PACKAGE.glob("*.py")]) <= 24


def test_imports_go_down_the_layers_never_up():
    upward = [(m, i) for m in package_modules() for i in imports_of(m)
              if _wing(i) != _wing(m) and RANK[_wing(i)] > RANK[_wing(m)]]
    assert upward == []


def test_the_runtime_wings_import_only_the_ones_before_them():
    # runtime/ (what every hook stands on), then hooks/, then dispatch/ (ARCHITECTURE.md): no folder imports up
    order = {"runtime": 0, "hooks": 1, "dispatch": 2}
    upward = [(m, i) for m in package_modules() if _wing(m) in order for i in imports_of(m)
              if _wing(i) in order and order[_wing(i)] > order[_wing(m)]]
    assert upward == []


def test_values_import_neither_cuda_queues_nor_hooks_nor_the_dry_run():
    values = [m for m in package_modules() if RANK[_wing(m)] == 0]
    assert [(m, i) for m in values for i in imports_of(m) if RANK[_wing(i)] > 0] == []


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_no_import_circles():
    modules = package_modules()
    graph = {m: imports_of(m) & set(modules) for m in modules}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    assert [m for m in modules if reaches(m, m, set())] == []


def function_level_imports() -> dict[str, list[str]]:
    """``{module: [absolute import statement, ...]}`` for every import inside a function of the package."""
    found: dict[str, list[str]] = {}
    for module, path in package_modules().items():
        tree = ast.parse(path.read_text())
        typing_only = _typing_only(tree)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
                    found.setdefault(module, []).append(_statement(module, node, path.name == "__init__.py"))
    return found


def _statement(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> str:
    if isinstance(node, ast.Import):
        return "import " + ", ".join(a.name for a in node.names)
    names = ", ".join(a.name for a in node.names)
    if not node.level:
        return f"from {node.module} import {names}"
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1] if node.level > 1 else base
    return f"from {'.'.join(['pipemap', *base, *([node.module] if node.module else [])])} import {names}"


_SAVING = """
import importlib, json, os, sys

class New(BaseException):  # not an Exception: lazy modules (diffusers', transformers') re-raise those as others
    pass

class Stop:  # asked only for a module not yet in sys.modules: the first one a statement would bring in
    @staticmethod
    def find_spec(name, path=None, target=None):
        raise New(name)

def verdicts(module, statements):
    importlib.import_module(module)
    sys.meta_path.insert(0, Stop)
    out = []
    for statement in statements:
        try:
            exec(statement, {})
        except New:  # stopped before that module ran: nothing is half loaded, the next statement starts as this did
            out.append(True)
        else:
            out.append(False)
    return out

for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
results = {}
for module, statements in json.loads(sys.argv[2]).items():  # each in a child forked from this process as it is
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = verdicts(module, statements)
        except BaseException as err:
            answer = repr(err)
        os.write(write, json.dumps(answer).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        results[module] = json.loads(pipe.read())
    os.waitpid(pid, 0)
print(json.dumps(results))
"""
# what most of the package's modules import anyway; loaded once, before the children fork
_PRELOAD = ("torch", "numpy", "safetensors", "huggingface_hub", "accelerate", "transformers", "diffusers")


def saving(preload: tuple[str, ...], statements: dict[str, list[str]]) -> dict[str, list[bool]]:
    """``{module: [whether each statement, run after ``import pipemap.<module>``, brings in a module]}``: each module
    checked in a child forked from one process that has imported ``preload`` first."""
    out = subprocess.run([sys.executable, "-c", _SAVING, json.dumps(preload),
                          json.dumps({f"pipemap.{m}": s for m, s in statements.items()})],
                         capture_output=True, text=True, check=True)
    return {m.removeprefix("pipemap."): v for m, v in json.loads(out.stdout.splitlines()[-1]).items()}


@pytest.mark.slow
def test_every_function_level_import_saves_start_up_time():
    # an import inside a function is allowed only where importing its module without it loads less: each statement,
    # run after a fresh ``import pipemap.<module>``, must bring in a module that import had not (torch, diffusers'
    # pipelines, rich, ray...); one that brings nothing new belongs at the top of its file. A statement is stopped
    # at the first new module it asks for (an optional library not installed, pynvml, counts as new), so each is
    # judged against the module's own imports and none pays for loading what it brings.
    # Each module is checked in a child forked from a process with torch, diffusers... imported (seconds, not a
    # fresh interpreter each): what is preloaded can only make a statement look useless, never useful, so a module
    # with such a statement is checked again from a bare process, which is exact.
    statements = function_level_imports()
    found = saving(_PRELOAD, statements)
    doubtful = {m: s for m, s in statements.items() if found[m] != [True] * len(s)}
    found |= saving((), doubtful) if doubtful else {}
    # per module, the statements that bring nothing new (or the error its child met, as a string)
    useless = {m: found[m] if isinstance(found[m], str) else [s for s, ok in zip(statements[m], found[m]) if not ok]
               for m in statements}
    assert {m: u for m, u in useless.items() if u} == {}


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


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_catalog_sizes_are_recorded_as_computed():
    from pipemap import catalog

    assert catalog.recorded_sizes() == {n: {c.name: c.bytes for c in catalog.inventory(n).models}
                                        for n in catalog.names()}, "refresh with catalog.write_sizes()"


def test_tiny_save_makes_a_folder_to_try(tmp_path, capsys):
    assert main(["tiny", "save", "sd", str(tmp_path / "tiny-sd")]) == 0
    hint = capsys.readouterr().out.split("try: pipemap ")[1].split()
    assert hint[:2] == ["plan", str(tmp_path / "tiny-sd")] and main(hint) == 0  # the command it suggests works
    plan = pipemap.plan(str(tmp_path / "tiny-sd"), hardware="2x5MiB,cpu=1GiB")
    assert set(plan.device_map) == {"text_encoder", "unet", "vae"}
    assert "[cuda:0]" in str(plan)  # a device label is printed, not swallowed as rich markup
