"""The command line: ``pipemap plan | simulate | demo | catalog | doctor``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from .errors import PipemapError


def main(argv: list[str] | None = None) -> int:
    """Run one ``pipemap`` command; returns the exit code (2 for bad input, with the error on stderr)."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    try:
        return args.run(args)
    except PipemapError as err:
        print(f"pipemap: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipemap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print where each component of a pipeline folder would go")
    plan.add_argument("path", help="a diffusers pipeline folder, or a catalog name (see `pipemap catalog`)")
    _plan_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    plan.add_argument("--picture", action="store_true", help="draw each device's memory as a bar (80 columns)")
    plan.add_argument("--svg", metavar="FILE", help="also write the picture as an SVG file")
    plan.set_defaults(run=_plan)
    simulate = commands.add_parser("simulate", help="dry-run a plan on stand-in devices: does it run, what peaks")
    simulate.add_argument("path", help="a diffusers pipeline folder; no weight is read")
    _plan_options(simulate)
    simulate.add_argument("--height", type=int)
    simulate.add_argument("--width", type=int)
    simulate.add_argument("--steps", type=int, default=2, help="denoising steps to run (default 2)")
    simulate.add_argument("--prompt", default="a dry run")
    simulate.set_defaults(run=_simulate)
    _add_run(commands)
    demo = commands.add_parser("demo", help="plan, load and run the embedded tiny pipeline end to end")
    demo.add_argument("--hardware", help="plan for this profile; devices this machine lacks run on the CPU")
    demo.add_argument("--strategy", default="balanced")
    demo.add_argument("--output", default="pipemap-demo.png", help="where to save the image (PNG)")
    demo.set_defaults(run=_demo)
    catalog = commands.add_parser("catalog", help="list the published pipelines `pipemap plan` takes by name")
    catalog.set_defaults(run=_catalog)
    doctor = commands.add_parser("doctor", help="devices, versions, and whether copies between GPUs arrive intact")
    doctor.set_defaults(run=_doctor)
    return parser


def _add_run(commands) -> None:
    run = commands.add_parser("run", help="load a pipeline folder onto its plan and generate one image")
    run.add_argument("path", help="a diffusers pipeline folder")
    _plan_options(run)
    run.add_argument("--prompt", required=True)
    run.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's)")
    run.add_argument("--height", type=int)
    run.add_argument("--width", type=int)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--output", default="pipemap-run.png", help="where to save the image (PNG)")
    run.set_defaults(run=_run)


def _plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", help="a profile such as 'cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB' or "
                        "'2x24GiB,cpu=64GiB' (default: this machine)")
    parser.add_argument("--strategy", default="balanced", help="balanced, sequential, or a JSON dict "
                        "'{\"vae\": \"cuda:1\"}'")
    parser.add_argument("--dtype", help="the dtype to load in, e.g. float16 or bfloat16")
    parser.add_argument("--variant", help="the weights variant, e.g. fp16")
    parser.add_argument("--headroom", type=float, help="fraction of each GPU kept for activations (default 0.1)")


def _strategy(text: str):
    return json.loads(text) if text.strip().startswith("{") else text


def _planned(args):
    """The plan the ``--hardware --strategy --dtype --variant --headroom`` options ask for."""
    from .planner import plan

    return plan(args.path, hardware=args.hardware, strategy=_strategy(args.strategy), dtype=args.dtype,
                variant=args.variant, headroom=args.headroom)


def _plan(args) -> int:
    result = _planned(args)
    print(result.to_json() if args.json else result)
    if args.picture or args.svg:
        _draw(args, result)
    return 0


def _draw(args, result) -> None:
    from rich.console import Console

    from .inventory import inspect
    from .picture import moved_per_image

    moved = moved_per_image(result, inspect(args.path, args.dtype, args.variant))
    picture = result.picture(moved)
    if args.picture:
        Console(width=80).print(picture)
    if args.svg:
        Path(args.svg).write_text(picture.svg(), encoding="utf-8")
        print(f"wrote {args.svg}")


def _simulate(args) -> int:
    from .simulate import simulate

    result = _planned(args)
    print(result)
    size = {k: v for k, v in (("height", args.height), ("width", args.width)) if v}
    report = simulate(args.path, result, steps=args.steps, prompt=args.prompt, **size)
    print(report)
    return 0 if report.ok else 1


def _run(args) -> int:
    from .demo import generate

    options = {k: v for k, v in (("num_inference_steps", args.steps), ("height", args.height),
                                 ("width", args.width)) if v}
    return generate(args.path, args.hardware, _strategy(args.strategy), args.dtype, args.variant, args.headroom,
                    args.prompt, args.seed, options, Path(args.output))


def _demo(args) -> int:
    from .demo import run_demo

    with tempfile.TemporaryDirectory(prefix="pipemap-demo-") as folder:
        return run_demo(Path(folder), args.hardware, _strategy(args.strategy), Path(args.output))


def _catalog(args) -> int:
    from .catalog import run_catalog

    return run_catalog()


def _doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor()
