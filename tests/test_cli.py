"""The command line, through ``pipemap.cli.main`` as ``python -m pipemap`` runs it; the demo also in a child process,
as a user starts it."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from helpers import pipemap_cli


@pytest.mark.slow
def test_plan_prints_a_table(tiny_folders):
    result = pipemap_cli("plan", tiny_folders["sdxl"], "--hardware", "2x5MiB,cpu=1GiB", "--headroom", "0")
    assert result.returncode == 0, result.stderr
    for word in ("unet", "text_encoder_2", "vae", "cuda:0", "cuda:1", "resident"):
        assert word in result.stdout


@pytest.mark.slow
def test_plan_json_with_dtype_and_map(tiny_folders):
    result = pipemap_cli("plan", tiny_folders["sd"], "--hardware", "2x24GiB", "--dtype", "float16", "--variant",
                         "fp16", "--strategy", '{"vae": "cuda:1"}', "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["components"]["vae"]["device"] == "cuda:1" and data["dtype"] == "float16"
    assert data["components"]["unet"]["mode"] == "resident"
    assert set(data["devices"]) == {"cuda:0", "cuda:1", "cpu"}


@pytest.mark.slow
def test_plan_error_is_reported_with_exit_code_2(tiny_folders, tmp_path):
    result = pipemap_cli("plan", str(tmp_path), "--hardware", "2x24GiB")
    assert result.returncode == 2 and "model_index.json" in result.stderr
    result = pipemap_cli("plan", tiny_folders["sd"], "--hardware", "2x24Gx")
    assert result.returncode == 2 and "24Gx" in result.stderr


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    output = tmp_path / "demo.png"
    result = pipemap_cli("demo", "--hardware", "2x5MiB,cpu=1GiB", "--output", str(output), child=True)
    assert result.returncode == 0, result.stderr
    assert "largest difference from an un-mapped run: 0" in result.stdout
    assert "cuda:1" in result.stdout
    assert Image.open(output).size == (32, 32)


@pytest.mark.slow
def test_demo_on_this_machine(tmp_path):
    result = pipemap_cli("demo", "--output", "demo.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo.png").is_file()


@pytest.mark.slow
def test_simulate_through_the_command_line_exits_1_when_a_peak_passes_its_gpu_and_0_within_budget(tiny_folders):
    # the tiny SDXL at 64x64 peaks at 9.96 MiB on cuda:0 (denoising) and 5.54 MiB on cuda:1 (VAE decode): it runs
    # on 4 MiB GPUs, and does not fit them
    options = ("--headroom", "0", "--strategy", "sequential", "--height", "64", "--width", "64", "--steps", "1")
    result = pipemap_cli("simulate", tiny_folders["sdxl"], "--hardware", "3x4MiB,cpu=1GiB", *options)
    assert result.returncode == 1, result.stderr
    assert "dry run DOES NOT FIT" in result.stdout and "cuda:2" in result.stdout
    over = [line for line in result.stdout.splitlines() if line.startswith("does not fit: ")]
    assert [line.split()[3] for line in over] == ["cuda:0:", "cuda:1:"] and "9.96 MiB" in over[0]
    assert "denoising (step 1) in 'unet'" in over[0] and "VAE decode in 'vae'" in over[1]
    result = pipemap_cli("simulate", tiny_folders["sdxl"], "--hardware", "3x4MiB,cpu=1GiB", *options, "--concurrent",
                         "2")
    assert result.returncode == 1 and "2 refused" in result.stdout, result.stderr  # no call fits: none ran
    result = pipemap_cli("simulate", tiny_folders["sdxl"], "--hardware", "3x16MiB,cpu=1GiB", *options)
    assert result.returncode == 0, result.stderr
    assert "dry run ok" in result.stdout and "does not fit" not in result.stdout


@pytest.mark.slow
def test_run_generates_an_image_with_an_offloading_plan(tiny_folders, tmp_path):
    output = tmp_path / "run.png"
    result = pipemap_cli("run", tiny_folders["sd"], "--prompt", "a tiny cat", "--hardware", "cuda:0=3.3MiB,cpu=1GiB",
                         "--headroom", "0", "--strategy", "balanced_low_memory", "--steps", "2", "--output",
                         str(output))
    assert result.returncode == 0, result.stderr
    assert "offload" in result.stdout and "bytes moved to its GPU" in result.stdout
    assert Image.open(output).size == (32, 32)


def test_run_with_parallel_plans_for_the_call_it_makes_not_the_default_one(flux_folder, tmp_path):
    output = tmp_path / "run.png"
    result = pipemap_cli("run", flux_folder, "--prompt", "a tiny cat", "--hardware", "2x64MiB,cpu=4GiB",
                         "--strategy", "parallel", "--steps", "2", "--height", "64", "--width", "64", "--ranks",
                         "thread", "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert "chosen for the call 64x64, 2 steps" in " ".join(result.stdout.split())
    assert Image.open(output).size == (64, 64)


def test_serve_flags_become_the_services_options(monkeypatch, tmp_path, capsys):
    pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
    import pipemap.serve
    from pipemap.cli import main
    from pipemap.serve.access import Access
    from pipemap.serve.connections import ConnectionLimits

    loaded, served = [], []
    made = type("S", (), {"plan": "a plan", "start": lambda self: None})
    monkeypatch.setattr(pipemap.serve.Service, "load", classmethod(lambda cls, options: loaded.append(options)
                                                                   or made()))

    def run(loading, host, port, connections):  # the server starts the load with its app: here, at once
        loading.start()
        loading._thread.join(30)
        served.append((host, port, connections))

    monkeypatch.setattr(pipemap.serve, "run", run)
    monkeypatch.setenv("PIPEMAP_API_KEY", "from-env")
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "8123", "--max-steps", "60", "--max-prompt",
                 "500", "--max-body", "9999", "--served-model-name", "sd", "sd-alias", "--max-batch", "4",
                 "--batch-window-ms", "30", "--max-frames", "33", "--head-timeout", "3", "--body-timeout", "7",
                 "--keep-alive", "2", "--max-connections", "99", "--max-head", "4096"]) == 0
    (options,) = loaded
    assert options.max_frames == 33
    assert (options.max_steps, options.max_prompt, options.names) == (60, 500, ("sd", "sd-alias"))
    assert (options.max_batch, options.batch_window) == (4, 0.03)
    assert options.access == Access(api_key="from-env", local=False, max_body=9999)
    assert served == [("0.0.0.0", 8123, ConnectionLimits(3.0, 7.0, 2.0, 99, 4096))]
    capsys.readouterr()
    assert main(["serve", str(tmp_path), "--api-key", "given"]) == 0
    assert loaded[-1].access == Access(api_key="given", local=True)
    assert "--api-key is visible to every user" in capsys.readouterr().err
    assert (loaded[-1].max_batch, loaded[-1].max_steps) == (8, None)  # batching on; the scheduler's step limit
    key = tmp_path / "key"
    key.write_text("from-file\n")
    assert main(["serve", str(tmp_path), "--api-key-file", str(key)]) == 0
    assert loaded[-1].access.api_key == "from-file" and "WARNING" not in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--api-key-file", str(key), "--api-key", "x"]) == 2  # one way only
    key.write_text("")
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--api-key-file", str(key)])
    assert "no key on its first line" in capsys.readouterr().err
    assert loaded[-1].names == () and loaded[-1].served_names() == (str(tmp_path),)  # the path as given


@pytest.mark.parametrize("gpu", ["b200", "mi300x"])
def test_plan_prices_a_current_gpu_named_in_the_spec(gpu, capsys):
    # in this process (no child): the catalog's FLUX.1-dev on two of a GPU the table added in issue 50, priced by "auto"
    from pipemap.cli import main

    assert main(["plan", "flux.1-dev", "--hardware", f"2x80GiB,cpu=256GiB,gpu={gpu}", "--strategy", "auto"]) == 0
    out = capsys.readouterr().out
    assert "s per image" in out and "transformer" in out


def test_serve_help_texts_are_the_readmes():
    import re
    from pathlib import Path

    from pipemap.cli import SERVE_OPTIONS, _parser

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(--[a-z-]+)[^`]*` \| (.*) \|$", readme, re.MULTILINE))
    serve = next(a for a in _parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    helps = {a.option_strings[0]: a.help for a in serve._actions if a.option_strings and a.help != "==SUPPRESS=="}
    for flags, _, text in SERVE_OPTIONS:
        assert rows.get(flags[0]) == text == helps[flags[0]], flags[0]


# ---- arguments checked before torch loads ------------------------------------------------------------------------

EARLY = """
import sys
from pipemap.cli import main
code = main(sys.argv[1:])
print("torch loaded" if "torch" in sys.modules else "no torch", code)
"""


def _early(*args: str):
    """``pipemap *args`` in a child process, with whether torch was imported by the time it answered."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", EARLY, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize(("args", "said"), [
    (("plan", "sdxl", "--strategy", "balance"), "did you mean 'balanced'?"),
    (("plan", "fluxdev"), "the nearest catalog names: flux.1-dev"),
    (("run", "flux-dev", "--prompt", "a cat"), "huggingface-cli download black-forest-labs/FLUX.1-dev --local-dir"),
    (("simulate", "sdxl", "--hardware", "2x16GBB"), "cannot read '16GBB' as a memory size"),
])
def test_a_bad_argument_answers_before_torch_is_imported(args, said):
    result = _early(*args)
    assert result.stdout.split() == ["no", "torch", "2"], result.stderr
    assert said in result.stderr and result.stderr.count("\n") == 1  # one line


def test_unknown_names_point_at_the_catalog_and_run_with_a_catalog_name_says_it_needs_a_folder():
    result = pipemap_cli("plan", "flux-schnel")
    assert result.returncode == 2 and "flux.1-" in result.stderr and "`pipemap catalog`" in result.stderr
    result = pipemap_cli("run", "sdxl", "--prompt", "a cat")
    assert result.returncode == 2 and "stabilityai/stable-diffusion-xl-base-1.0" in result.stderr
    assert "`pipemap plan sdxl` and `pipemap simulate sdxl` need no download" in result.stderr


def test_strategy_names_are_case_insensitive_and_mixed_names_match_the_planner():
    from pipemap.cli import MIXED_NAMES, _strategy_name
    from pipemap.planner import MIXED

    assert MIXED_NAMES == tuple(MIXED)
    assert _strategy_name("Balanced") == "balanced" and _strategy_name(" AUTO ") == "auto"
    assert _strategy_name('{"vae": "cuda:1"}') == '{"vae": "cuda:1"}'
    result = pipemap_cli("plan", "sd1.5", "--hardware", "2x24GiB,cpu=64GiB", "--strategy", "Balanced_Low_Memory")
    assert result.returncode == 0 and "strategy 'balanced_low_memory'" in result.stdout, result.stderr


def test_decimal_units_in_hardware_are_read_with_a_note(tiny_folders):
    result = pipemap_cli("plan", tiny_folders["sd"], "--hardware", "2x16GB,cpu=64GB,host_bw=25GB", "--json")
    assert result.returncode == 0, result.stderr
    notes = result.stderr.splitlines()
    assert notes == ["pipemap: note: --hardware read '16GB' as 16 x 10^9 bytes = 14.90 GiB (GB: powers of 1000); "
                     "write 16GiB for 16 x 2^30 bytes",
                     "pipemap: note: --hardware read '64GB' as 64 x 10^9 bytes = 59.60 GiB (GB: powers of 1000); "
                     "write 64GiB for 64 x 2^30 bytes"]  # host_bw=25GB is a speed: no note
    assert json.loads(result.stdout)["devices"]["cuda:0"]["memory"] == 16 * 10**9


def test_every_option_of_every_command_has_help_text():
    import argparse

    from pipemap.cli import _parser

    def commands(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield name, sub
                    yield from ((f"{name} {n}", s) for n, s in commands(sub))

    missing = [f"{name} {action.dest}" for name, sub in commands(_parser()) for action in sub._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help]
    assert missing == []
