"""The README's snippets, run as written: every ```python block and every command of a ```bash block (and the
``$ pipemap ...`` lines of its ```text outputs) is found by parsing README.md, so a new snippet is picked up. The
placeholder folders become tiny pipelines built in code, catalog names stay catalog names (nothing is downloaded),
and a snippet the test cannot run is listed in ``SKIP`` by its first line, with the reason.

What a snippet uses without defining it (a plan, a pipeline, prompts) comes from its ``PRELUDE``; where the README's
value would take long on 2 cores (50 steps under the fake CUDA), ``SUBSTITUTE`` names the change and why. Snippets
that address GPUs by index (``max_memory={0: ...}``, ``strategy={"vae": "cuda:1"}``) need GPUs to exist: they run on
the fake CUDA's two GPUs (``tests/fakecuda.py``); a ``hardware=`` spec naming GPUs runs them on the CPU with a
``UserWarning``, as designed. Where the prose above a command states its time ("21 s of CPU"), the run must take
no more CPU than that (``STATED``, within ``MARGIN`` for a slower machine). The serve block runs as a user runs it:
``pipemap serve`` in a child on a free port, then the README's ``curl`` line against it.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import pipemap_cli
from pipemap import tiny

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Snippet:
    """One fenced block of README.md: its language, the line its text starts on, and its text."""

    lang: str
    line: int
    text: str
    before: str  # the prose between the block above and this one

    @property
    def first(self) -> str:
        return next(line.strip() for line in self.text.splitlines() if line.strip())

    def commands(self) -> list[str]:
        """The shell commands of a bash block (continuations joined), or the ``$ `` lines of a text block."""
        if self.lang == "text":
            return [line[2:].strip() for line in self.text.splitlines() if line.startswith("$ ")]
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def snippets() -> list[Snippet]:
    """Every ```python and ```bash block of README.md, and every ```text block that shows a command run."""
    found, lang, start, body, prose = [], None, 0, [], []
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and lang is None:
            lang, start, body = fence.group(1), number + 1, []
        elif fence:
            found.append(Snippet(lang, start, "\n".join(body), " ".join(prose)))
            lang, prose = None, []
        else:
            (body if lang is not None else prose).append(line)
    runnable = [s for s in found if s.lang in ("python", "bash") or (s.lang == "text" and s.commands())]
    return runnable


# ---- what the test does not run, and why -----------------------------------------------------------------------

# A command (or a python block) whose first line starts with one of these is not run.
SKIP = {
    "bash scripts/demo.sh": "installs into .venv (tests/test_demo.py runs `pipemap demo` itself)",
    "bash scripts/test.sh": "installs into .venv, then runs the whole suite",
    "pip install": "installs into the environment",
    "python -m pytest -q tests/test_families.py": "runs a test file of its own (every family: minutes)",
    "pipemap serve path/to/flux --ray": "needs Ray (tests/serve runs the Ray deployment)",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=": "starts a Ray head node (tests/serve/test_deployment_cluster.py "
    "simulates a cluster)",
    "PIPEMAP_NODE_HARDWARE=": "starts a Ray node (tests/serve/test_deployment_cluster.py simulates a cluster)",
    "RAY_ADDRESS=": "needs a Ray cluster (tests/serve/test_deployment_cluster.py simulates one)",
    "serve deploy": "needs a Ray cluster (tests/serve/test_deployment_cluster.py deploys the file on one)",
    "pipemap plan PATH|NAME": "the synopsis: placeholders, checked against --help by test_the_synopsis_names_...",
    "pipemap simulate PATH|NAME": "the synopsis",
    "[--concurrent N]": "the synopsis",
    "pipemap run PATH --prompt TEXT": "the synopsis",
    "pipemap serve PATH|NAME": "the synopsis",
    "[--max-n N]": "the synopsis",
    "[--api-key-file PATH]": "the synopsis",
    "[--head-timeout S]": "the synopsis",
    "[--ray [--replicas": "the synopsis",
    "[--proxy-location": "the synopsis",
    "pipemap demo [--hardware SPEC]": "the synopsis",
    "pipemap tiny save KIND FOLDER": "the synopsis",
}

# ---- what a snippet is given ------------------------------------------------------------------------------------

# Names a python block uses without defining them, by the block's first line (placeholders are replaced after).
PRELUDE = {
    "import torch, pipemap": "",
    "report = pipemap.simulate(": (  # the plan of the block above
        "import torch, pipemap\n"
        "plan = pipemap.plan('path/to/sdxl', hardware='2x16GiB,cpu=64GiB', dtype=torch.float16, variant='fp16')\n"),
    "calls = [{\"prompt\": \"a cat\"": (  # the Flux plan of the dry-run block
        "import pipemap\n"
        "flux = pipemap.plan('flux.1-dev', hardware='2x16GiB', strategy='auto')\n"),
    "pipe = pipemap.load(\"path/to/sdxl\", device_map=\"balanced_low_memory\"": (
        "import pipemap\n"
        "from diffusers import UNet2DConditionModel\n"
        "other_unet = UNet2DConditionModel.from_pretrained('path/to/sdxl', subfolder='unet')\n"),
    "plan = pipemap.plan(\"flux.1-dev\", hardware=\"1x24GiB": "import pipemap\n",
    "plan = pipemap.plan(\"flux.1-dev\", hardware=\"2x80GiB\", strategy=\"parallel\")": "import pipemap\n",
    "plan = pipemap.plan(\"path/to/sdxl\", hardware=\"2x24GiB\"": "import torch, pipemap\n",
    "calls = [{\"prompt\": p": (  # the pipeline of the block above
        "import torch, pipemap\n"
        "pipe = pipemap.load('path/to/sdxl', plan=pipemap.plan('path/to/sdxl', hardware='2x24GiB',"
        " strategy='parallel'))\n"
        "prompts = ['a cat', 'a dog', 'a fox']\n"),
}

# (README text, what runs instead, why): only where the README's value would take long here.
SUBSTITUTE = {
    "import torch, pipemap": [
        ('pipe("a photo of a cat")', 'pipe("a photo of a cat", num_inference_steps=2)',
         "50 steps under the fake CUDA take 22 s"),
    ],
    "curl -s localhost:8000/v1/images/generations": [
        ('"size": "1024x1024"', '"size": "128x128"', "1024x1024 on the tiny SDXL's attention: over 300 s on 2 cores"),
        ('"num_inference_steps": 30', '"num_inference_steps": 2', "30 steps of it: minutes"),
    ],
}

# Blocks that address GPUs by index: run on the fake CUDA's two GPUs.
ON_FAKE_GPUS = {"import torch, pipemap", "pipe = pipemap.load(\"path/to/sdxl\", device_map=\"balanced_low_memory\""}

# The CPU time the README states for a block's command, in the prose just above it ("... 17 s of CPU"); a run may
# take this much more (a slower machine than the one that measured it).
STATED = re.compile(r"(\d+(?:\.\d+)?) s of CPU")
MARGIN = 1.5


def _entry(table: dict, first: str):
    """The table's entry for the snippet or command whose first line is ``first`` (the longest key it starts with)."""
    keys = [key for key in table if first.startswith(key)]
    return table[max(keys, key=len)] if keys else None


# ---- the tiny folders -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_folders) -> dict[str, str]:
    """What each placeholder path of the README stands for: tiny pipelines, and a LoRA of the tiny SDXL's unet."""
    from everyday import save_lora

    root = tmp_path_factory.mktemp("readme")
    return {"path/to/sdxl": tiny_folders["sdxl"], "path/to/sd": tiny_folders["sd"],
            "path/to/flux": str(tiny.save("flux", root / "flux")),
            "path/to/lora": save_lora("sdxl", root / "lora", seed=1)}


def _placed(text: str, places: dict[str, str]) -> str:
    for placeholder, folder in places.items():
        text = text.replace(placeholder, folder)
    return text


def _substituted(text: str, first: str) -> str:
    for old, new, _why in _entry(SUBSTITUTE, first) or []:
        assert old in text, f"the substitution of {old!r} no longer matches the snippet {first!r}"
        text = text.replace(old, new)
    return text


SHOWN = re.compile(r"^(?P<expr>[^#\s].*?)\s+#\s*(?P<shown>.+?)\s*$")


def _checked(text: str) -> str:
    """The snippet with each output it shows checked: ``expr  # {literal}`` becomes an assertion that ``expr``
    equals it, ``print(expr)  # its text ...`` one that the text starts so (line numbers kept)."""
    return "\n".join(_check(line) for line in text.splitlines())


def _check(line: str) -> str:
    shown = SHOWN.match(line)
    if shown is None:
        return line
    expr, text = shown["expr"], shown["shown"]
    if text.startswith("{"):
        with contextlib.suppress(ValueError, SyntaxError):
            return f"assert ({expr}) == {ast.literal_eval(text)!r}, ({expr})"
    printed = re.fullmatch(r"print\((.*)\)", expr)
    if printed and text.endswith(" ..."):
        return f"assert str({printed[1]}).startswith({text[:-4]!r}), str({printed[1]})"
    return line


def _ids(found: list[Snippet]) -> list[str]:
    return [f"{s.line}:{s.first[:50]}" for s in found]


PYTHON = [s for s in snippets() if s.lang == "python"]
COMMANDS = [s for s in snippets() if s.lang != "python"]


# ---- the tests --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("snippet", PYTHON, ids=_ids(PYTHON))
def test_the_python_snippet_runs_as_written(snippet, places, request, monkeypatch):
    if (reason := _entry(SKIP, snippet.first)) is not None:
        pytest.skip(reason)
    monkeypatch.delenv("PIPEMAP_WORKERS", raising=False)  # as a user runs it: a split's ranks in worker processes
    prelude = _entry(PRELUDE, snippet.first)
    assert prelude is not None, f"README.md:{snippet.line}: a new python snippet; give it a PRELUDE (or a SKIP)"
    gpus = request.getfixturevalue("fake_cuda") if any(snippet.first.startswith(k) for k in ON_FAKE_GPUS) else None
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if gpus is None else "default", UserWarning)  # GPUs remapped onto the CPU
        exec(compile(_placed(prelude, places), "prelude", "exec"), namespace)
        text = _checked(_placed(_substituted(snippet.text, snippet.first), places))
        exec(compile(text, f"README.md:{snippet.line}", "exec"), namespace)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", COMMANDS, ids=_ids(COMMANDS))
def test_the_commands_run_as_written(snippet, places, tmp_path):
    ran, port = 0, None
    with contextlib.ExitStack() as servers:
        for command in snippet.commands():
            if _entry(SKIP, command) is not None:
                continue
            words = _words(command, places, tmp_path)
            if command.startswith("curl "):
                assert port is not None, f"{command!r}: no `pipemap serve` before it in its block"
                _ask(_substituted(command, command), port, tmp_path)
            elif words[0] == "serve":
                port = servers.enter_context(_serving(words, tmp_path))
            else:
                _run(command, words, tmp_path, STATED.findall(snippet.before))
            ran += 1
    if not ran:
        pytest.skip("; ".join(f"{c}: {_entry(SKIP, c)}" for c in snippet.commands()))


def _words(command: str, places: dict[str, str], tmp_path: Path) -> list[str]:
    """A command's words, placeholders replaced, ``/tmp/...`` outputs moved to the test's folder."""
    words = shlex.split(command, comments=True)
    if words[0].endswith("pipemap"):
        words = words[1:]
    return [str(tmp_path / Path(w).name) if w.startswith("/tmp/") else _placed(w, places) for w in words]


def _run(command: str, words: list[str], tmp_path: Path, stated: list[str]) -> None:
    """A ``pipemap`` command, in this process; within the CPU time the README states for it."""
    assert words and words[0] in ("plan", "simulate", "tiny", "run", "demo", "catalog", "doctor"), (
        f"{command!r} is neither a pipemap command nor in SKIP")
    start = time.process_time()
    result = pipemap_cli(*words, cwd=tmp_path)
    seconds = time.process_time() - start
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    if stated:
        assert seconds <= float(stated[-1]) * MARGIN, f"{command}: {seconds:.1f} s of CPU; the README: {stated[-1]} s"


@contextlib.contextmanager
def _serving(words: list[str], tmp_path: Path):
    """``pipemap serve`` as the README starts it, in a child, on a free port instead of the README's; yields once it
    answers ``/health/ready``."""
    httpx = pytest.importorskip("httpx", reason="the serve snippet needs httpx: pip install -e '.[test]'")
    with socket.socket() as probe:  # a port free now; the server binds it a few seconds later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    where = words.index("--port") + 1
    words = [*words[:where], str(port), *words[where + 1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "pipemap", *words], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        try:
            with httpx.Client(base_url=f"http://localhost:{port}", timeout=10) as session:
                for _ in range(300):
                    assert server.poll() is None, log.read_text()
                    with contextlib.suppress(httpx.TransportError):
                        if session.get("/health/ready").status_code == 200:
                            break
                    time.sleep(1)
            yield port
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:  # still finishing a request: not what this test is about
                server.kill()
                server.wait()


def _ask(command: str, port: int, tmp_path: Path) -> None:
    """A ``curl`` line of the README against the server the block started (its port for 8000; ``python`` this one)."""
    line = command.replace("localhost:8000", f"localhost:{port}").replace("| python ", f"| {sys.executable} ")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    written = re.search(r'open\("([^"]+)", "wb"\)', command)
    if written:  # what the README's client writes: an image of the size it asked for
        size = re.search(r'"size": "(\d+)x(\d+)"', command)
        from PIL import Image

        with Image.open(tmp_path / written[1]) as image:
            assert size is None or image.size == (int(size[1]), int(size[2]))

def test_every_table_entry_names_a_snippet_of_the_readme():
    # a table entry that matches nothing has gone stale: the README changed under it
    firsts = [s.first for s in PYTHON] + [c for s in COMMANDS for c in s.commands()]
    for table in (SKIP, PRELUDE, SUBSTITUTE, dict.fromkeys(ON_FAKE_GPUS)):
        for key in table:
            assert any(first.startswith(key) for first in firsts), f"{key!r} matches no snippet of README.md"
    assert len(PYTHON) >= 7 and len(COMMANDS) >= 10  # the parser finds the blocks
    stated = [s for s in COMMANDS if STATED.search(s.before)]
    assert [s.commands() for s in stated] == [["pipemap simulate flux.1-dev --hardware 2x16GiB"],
                                              ["pipemap simulate flux.1-dev --hardware 2x16GiB --concurrent 2"]]


@pytest.mark.slow
def test_the_synopsis_names_only_options_that_exist():
    # the command-line synopsis and the OPTIONS table: every option they name is in that command's --help
    synopsis = next(s for s in COMMANDS if s.first.startswith("pipemap plan PATH|NAME"))
    named: dict[str, set[str]] = {}
    current = ""
    for line in synopsis.text.splitlines():
        command = re.match(r"pipemap (\w+)", line.strip())
        current = command[1] if command else current  # a continuation line belongs to the command above
        named.setdefault(current, set()).update(re.findall(r"--[a-z][a-z-]*", line.split("#")[0]))
    text = README.read_text(encoding="utf-8")
    options = text[text.index("`OPTIONS` (for"):]
    options = options[:options.index("\n\n", options.index("| option"))]  # that table only, not serve's own
    table = re.findall(r"^\| `(--[a-z-]+)", options, flags=re.MULTILINE)
    for command in ("plan", "simulate", "run"):
        named[command].update(table)
    assert set(named) >= {"plan", "simulate", "run", "serve", "demo", "tiny", "catalog", "doctor"}
    for command, options in named.items():
        helped = pipemap_cli(*command.split(), "--help" if command != "tiny" else "save", "--help")
        assert helped.returncode == 0, helped.stderr
        missing = {option for option in options if option not in helped.stdout}
        assert not missing, f"`pipemap {command}` has no {sorted(missing)}"
