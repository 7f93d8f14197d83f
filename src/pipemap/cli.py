"""The command line: ``pipemap plan | simulate | run | serve | demo | tiny | catalog | doctor``.

Only the standard library is imported here: each command imports what it needs when it runs, so ``--help`` and
``catalog`` answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

from .errors import (
    ArgumentConflictError,
    ArgumentTypeError,
    DecimalSizeWarning,
    FolderNotEmptyError,
    HardwareSpecError,
    HeadroomError,
    NotAPipelineError,
    OutputPathError,
    PipemapError,
    UnknownStrategyError,
)
from .modes import RANKS
from .quiet import quiet_progress
from .units import decimal_note, parse_bytes

# the same names as planner.STRATEGIES and "auto" (a test checks they agree); written out so --help imports no torch
STRATEGY_NAMES = ("balanced", "sequential", "balanced_low_memory", "balanced_ultra_low_memory", "balanced_split",
                  "parallel", "auto")
MIXED_NAMES = ("balanced_split+low_memory", "balanced_split+ultra_low_memory")  # planner.MIXED, checked by a test
TINY_KINDS = ("sd", "sdxl", "controlnet", "flux")  # tiny.ALL_KINDS, checked by the same test


def main(argv: list[str] | None = None) -> int:
    """Run one ``pipemap`` command; returns the exit code (2 for bad input, with the error on stderr)."""
    args = _parser().parse_args(argv)
    _quiet_libraries()
    try:
        _check_early(args)
        return args.run(args)
    except PipemapError as err:
        print(f"pipemap: error: {err}", file=sys.stderr)
        return 2


def _quiet_libraries() -> None:
    """Library chatter that tells a command-line user nothing: info logs, and warnings about library internals."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for module in ("torch", "diffusers", "transformers", "accelerate", "huggingface_hub"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        warnings.filterwarnings("ignore", category=UserWarning, module=module)


def _check_early(args) -> None:
    """What can be checked without torch, checked before any command imports it (5 s of CPU): a bad name or
    strategy answers at once. The API checks everything again; this only answers sooner."""
    if getattr(args, "strategy", None) is not None:
        args.strategy = _strategy_name(args.strategy)
    if getattr(args, "hardware", None):
        _hardware_sizes(args.hardware)
    if getattr(args, "path", None) is not None and args.command in ("plan", "simulate", "run"):
        _check_source(args.path, args.command)


def _strategy_name(text: str) -> str:
    """``--strategy`` in lower case if it names a strategy (``Balanced`` is balanced); a JSON dict as it is."""
    if text.strip().startswith("{"):
        return text
    name = text.strip().lower()
    if name not in STRATEGY_NAMES + MIXED_NAMES:
        raise UnknownStrategyError(text, STRATEGY_NAMES + MIXED_NAMES)
    return name


# the cost model's figures in a hardware spec (hardware._PERF_KEYS but reserve=, a size): speeds and names
_FIGURES = ("gpu", "flops", "attention", "host_bw", "peer_bw", "mem_bw", "disk_bw")


def _hardware_sizes(spec: str) -> None:
    """Each memory size of ``--hardware`` read (``hardware.Hardware.parse`` reads the rest), and a note on stderr
    for each given in GB/MB: powers of 1000, so ``2x16GB`` is two GPUs of 14.90 GiB, not 16."""
    for part in (p.strip() for p in spec.split(",")):
        key, has_name, value = part.partition("=")
        if not part or (has_name and key.strip().lower() in _FIGURES):
            continue
        count, times, size = part.partition("x")
        text = (value if has_name else size if times and count.strip().isdigit() else part).strip()
        try:
            parse_bytes(text)
        except ValueError as err:
            raise HardwareSpecError(spec, part, str(err)) from err
        _decimal_note(text)


def _decimal_note(text: str) -> None:
    note = decimal_note(text)
    if note is not None:
        print(f"pipemap: note: --hardware {note}", file=sys.stderr)
        # the note is said here, before torch loads: Hardware.parse's warning of it would say it twice
        warnings.filterwarnings("ignore", category=DecimalSizeWarning)


def _check_source(path: str, command: str) -> None:
    """A folder, or (for ``plan`` and ``simulate``) a catalog name; ``run`` needs the downloaded folder."""
    if Path(path).exists():
        return
    from . import catalog  # its names are JSON files beside it: no torch

    name = catalog.resolve(path)
    if name is None:
        raise catalog.unknown(path)
    if command == "run":
        repo = catalog.entries()[name].repo
        raise NotAPipelineError(path, f"it is the catalog's {name} ({repo}), and `run` loads its weights, so it needs "
                                f"the downloaded folder: `huggingface-cli download {repo} --local-dir {name}`, then "
                                f"`pipemap run {name} --prompt ...` (`pipemap plan {path}` and `pipemap simulate "
                                f"{path}` need no download)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipemap", description="Place a diffusers pipeline across the GPUs and CPU "
                                     "RAM of a machine: plan it, dry-run it, load and run it.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print where each component of a pipeline folder would go")
    plan.add_argument("path", help="a diffusers pipeline folder, or a catalog name (see `pipemap catalog`)")
    _plan_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    plan.add_argument("--picture", action="store_true", help="draw each device's memory as a bar (80 columns)")
    plan.add_argument("--svg", metavar="FILE", help="also write the picture as an SVG file")
    plan.set_defaults(run=_plan)
    simulate = commands.add_parser("simulate", help="dry-run a plan on stand-in devices: does it run, what peaks")
    simulate.add_argument("path", help="a diffusers pipeline folder (no weight is read) or a catalog name (nothing "
                          "is downloaded; see `pipemap catalog`)")
    _plan_options(simulate)
    simulate.add_argument("--height", type=int, help="image height in pixels (default: the pipeline's)")
    simulate.add_argument("--width", type=int, help="image width in pixels (default: the pipeline's)")
    simulate.add_argument("--steps", type=int, default=2, help="denoising steps to run (default 2; steps repeat, "
                          "so the peak of 2 is the peak of 50)")
    simulate.add_argument("--output-type", help="the pipeline's output_type (pil, np, pt, latent; default pt)")
    simulate.add_argument("--vae-tiling", action="store_true", help="call vae.enable_tiling() before the call")
    simulate.add_argument("--prompt", default="a dry run", help="the prompt (its length sets the text encoders' "
                          "work; default 'a dry run')")
    simulate.add_argument("--svg", metavar="FILE", help="also write each device's memory over the call as SVG")
    simulate.add_argument("--concurrent", type=int, metavar="N", help="also run N such calls at once, as run_many "
                          "and serve do, each admitted by the memory it needs: each device's peak with the requests "
                          "overlapped, and how many ran at once")
    # the dry run asks "does it fit, and how": auto weighs every strategy, splits and offloads included
    simulate.set_defaults(run=_simulate, strategy="auto")
    _add_run(commands)
    _add_serve(commands)
    demo = commands.add_parser("demo", help="plan, load and run the embedded tiny pipeline end to end")
    demo.add_argument("--hardware", help="plan for this profile; devices this machine lacks run on the CPU")
    demo.add_argument("--strategy", default="balanced", help=_STRATEGY_HELP)
    demo.add_argument("--output", default="pipemap-demo.png", help="where to save the image (PNG)")
    demo.set_defaults(run=_demo)
    tiny = commands.add_parser("tiny", help="save a tiny pipeline (random weights, a few MB) to try pipemap on")
    tiny_commands = tiny.add_subparsers(dest="tiny_command", required=True)
    save = tiny_commands.add_parser("save", help="build a tiny pipeline in code and save it to a folder")
    save.add_argument("kind", choices=TINY_KINDS, help="sd, sdxl, controlnet (UNet pipelines) or flux (transformer)")
    save.add_argument("folder", help="where to save it (made if missing; must be empty if it exists)")
    save.set_defaults(run=_tiny_save)
    catalog = commands.add_parser("catalog", help="list the published pipelines `pipemap plan` takes by name")
    catalog.set_defaults(run=_catalog)
    doctor = commands.add_parser("doctor", help="devices, versions, and whether copies between GPUs arrive intact")
    doctor.set_defaults(run=_doctor)
    return parser


def _add_run(commands) -> None:
    run = commands.add_parser("run", help="load a pipeline folder onto its plan and generate one image")
    run.add_argument("path", help="a diffusers pipeline folder")
    _plan_options(run)
    run.add_argument("--prompt", required=True, help="what to generate")
    run.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's)")
    run.add_argument("--height", type=int, help="image height in pixels (default: the pipeline's)")
    run.add_argument("--width", type=int, help="image width in pixels (default: the pipeline's)")
    run.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0): the same seed, the same "
                     "image")
    run.add_argument("--output", default="pipemap-run.png", help="where to save the image (PNG)")
    run.set_defaults(run=_run)


def _key_file(path: str) -> str:
    """``--api-key-file``'s type: the key on the file's first line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read the API key file {path!r}: {err.strerror}") from None
    if not lines or not lines[0].strip():
        raise argparse.ArgumentTypeError(f"the API key file {path!r} has no key on its first line: write it there")
    return lines[0].strip()


# ``pipemap serve``'s own options, one row each: flags, argparse settings, and the help text, which is also the
# README's (a test checks the two agree)
SERVE_OPTIONS: tuple[tuple[tuple[str, ...], dict, str], ...] = (
    (("--host",), {"default": "127.0.0.1"}, "the address to bind (default 127.0.0.1: this machine only)"),
    (("--port",), {"type": int, "default": 8000}, "the port (default 8000)"),
    (("--max-queue",), {"type": int, "default": 16}, "requests waiting at most; then 429 (default 16)"),
    (("--timeout",), {"type": float, "default": 300.0}, "seconds a request may take, its dry run included; then 504 "
     "(default 300)"),
    (("--max-n",), {"type": int, "default": 4}, "images a request may ask for (default 4)"),
    (("--workers",), {"type": int}, "requests in flight at once, their stages overlapped (default: as many "
     "default-size requests as the plan's room holds, at most 8)"),
    (("--api-key",), {}, "the bearer token /v1/ routes want; visible to every local user in ps, so prefer "
     "--api-key-file or PIPEMAP_API_KEY (default: $PIPEMAP_API_KEY; none: no key)"),
    (("--api-key-file",), {"metavar": "PATH", "type": _key_file}, "a file holding the bearer token /v1/ routes "
     "want, on its first line"),
    (("--served-model-name",), {"nargs": "+", "metavar": "NAME", "default": ()}, "the model names requests may give "
     "(the first is listed by /v1/models; default: PATH)"),
    (("--max-steps",), {"type": int}, "num_inference_steps a request may ask for (default: the scheduler's "
     "num_train_timesteps, 1000 where it has none)"),
    (("--max-prompt",), {"type": int, "default": 4000}, "characters a prompt may have (default 4000)"),
    (("--max-frames",), {"type": int, "default": 256}, "num_frames a video request may ask for (default 256)"),
    (("--max-body",), {"type": int, "default": 1 << 20}, "bytes a request body may have; then 413 (default 1 MiB)"),
    (("--max-batch",), {"type": int, "default": 8}, "requests of one shape (one image each) run as one call, at "
     "most, as the plan's memory allows (default 8; 1: no batching)"),
    (("--batch-window-ms",), {"type": float, "default": 20.0}, "milliseconds a request waits for others of its "
     "shape (default 20)"),
    (("--head-timeout",), {"type": float, "default": 10.0}, "seconds a request head may take, from the connection's "
     "start or its previous answer; then 408 and closed (default 10)"),
    (("--body-timeout",), {"type": float, "default": 60.0}, "seconds a request body may take after its head; then 408 "
     "and closed (default 60)"),
    (("--keep-alive",), {"type": float, "default": 5.0}, "seconds an idle connection is kept between requests "
     "(default 5)"),
    (("--max-connections",), {"type": int}, "connections open at once; past it the oldest idle one is closed, or 503 "
     "(default: the file limit less 64, at most 1024)"),
    (("--max-head",), {"type": int, "default": 64 * 1024}, "bytes of a request line and headers; then 431 (default "
     "65536)"),
    (("--ray",), {"action": "store_true"}, "run as a Ray Serve deployment (pipemap[ray])"),
    (("--replicas",), {"type": int, "default": 1}, "with --ray: this many replicas"),
    (("--autoscale",), {"metavar": "MIN:MAX"}, "with --ray: replicas scaled on queue length"),
    (("--ray-public",), {"action": "store_true"}, "with --ray and no RAY_ADDRESS: bind the local Ray's own ports on "
     "all interfaces (default: 127.0.0.1 only)"),
    (("--replicas-per-node",), {"type": int, "metavar": "N"}, "with --ray: at most N replicas on one node (default: "
     "as many as fit)"),
    (("--proxy-location",), {"choices": ("HeadOnly", "EveryNode"), "default": "HeadOnly"}, "with --ray: where Ray "
     "Serve's HTTP proxies run (default HeadOnly: the head node's --host:--port; EveryNode: one per node, behind a "
     "load balancer)"),
    (("--config-out",), {"metavar": "FILE"}, "with --ray: write the deployment as a Ray Serve config file (for serve "
     "deploy FILE or a KubeRay RayService) and exit"),
)


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="serve a pipeline over HTTP (OpenAI images API), or on Ray Serve")
    serve.add_argument("path", help="a diffusers pipeline folder, or a catalog name / Hub repo id in the HF cache")
    _plan_options(serve)
    for flags, settings, text in SERVE_OPTIONS:
        serve.add_argument(*flags, **settings, help=text)
    serve.set_defaults(run=_serve)


def _plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", help="a profile such as 'cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB' or "
                        "'2x24GiB,cpu=64GiB' (default: this machine)")
    parser.add_argument("--strategy", default="balanced", help=_STRATEGY_HELP)
    parser.add_argument("--dtype", help="the dtype to load in: float16, bfloat16 or float32 (default: the folder's)")
    parser.add_argument("--variant", help="the weights variant, e.g. fp16")
    parser.add_argument("--headroom", help="kept free on each GPU for activations: a fraction (0.1, the default), "
                        "bytes ('2GiB'), a JSON dict per device ('{\"cuda:0\": \"4GiB\"}') or 'measure' (a dry "
                        "run measures it)")
    parser.add_argument("--ranks", default="auto", choices=("auto", *RANKS),
                        help="what runs the other ranks of a denoiser split across GPUs (strategy parallel): a "
                        "worker process per GPU (process), threads of this process (thread), Ray actors (ray); auto "
                        "(the default): PIPEMAP_WORKERS where set, else process")


_STRATEGY_HELP = (f"one of {', '.join(STRATEGY_NAMES)} (auto: the fastest plan that fits), or a JSON dict "
                  "'{\"vae\": \"cuda:1\"}' whose missing components balanced places (default balanced)")


def _strategy(text: str):
    try:
        return json.loads(text) if text.strip().startswith("{") else text
    except json.JSONDecodeError as err:
        raise UnknownStrategyError(text, STRATEGY_NAMES, f"--strategy is not valid JSON: {err}") from None


def _headroom(text: str | None):
    """``--headroom`` as the API takes it: a JSON dict, a number (a fraction if it has a point, else bytes), a size
    with a unit, or ``measure``."""
    if text is None or text.strip() == "measure":
        return text
    try:
        return json.loads(text) if text.strip().startswith("{") else text
    except json.JSONDecodeError as err:
        raise HeadroomError(text, f"--headroom is not valid JSON ({err})") from None


def _request(args):
    """The request the ``--hardware --strategy --dtype --variant --headroom --ranks`` options make
    (``api.Request``)."""
    from .api import Request  # here: it imports torch, which --help does not need

    return Request.of(args.path, hardware=args.hardware, strategy=_strategy(args.strategy), dtype=args.dtype,
                      variant=args.variant, headroom=_headroom(args.headroom), ranks=args.ranks)


def _plan(args) -> int:
    request = _request(args)
    result = request.plan()
    print(result.to_json() if args.json else result)
    if args.picture or args.svg:
        _draw(args, request, result)
    return 0


def _draw(args, request, result) -> None:
    from rich.console import Console

    from .cost import bytes_moved

    moved = {k: v for k, v in bytes_moved(result, request.inventory()).items() if v}
    picture = result.picture(moved)
    if args.picture:
        Console(width=80).print(picture)
    if args.svg:
        Path(args.svg).write_text(picture.svg(), encoding="utf-8")
        print(f"wrote {args.svg}")


def _simulate(args) -> int:
    from .api import simulate

    result = _request(args).plan()
    print(result)
    options = {k: v for k, v in (("height", args.height), ("width", args.width), ("output_type", args.output_type))
               if v}
    if args.concurrent:
        return _simulate_many(args, result, dict(options, prompt=args.prompt))
    report = simulate(args.path, result, steps=args.steps, vae_tiling=args.vae_tiling, prompt=args.prompt, **options)
    print(report)
    if args.svg:
        Path(args.svg).write_text(report.picture().svg(), encoding="utf-8")
    return 0 if report.fits else 1  # it ran and every peak is within its device's memory


def _simulate_many(args, plan, call: dict) -> int:
    """``simulate --concurrent N``: the call's own dry run, then N of them at once under the memory ledger."""
    from .api import simulate_many

    if args.concurrent < 1 or args.vae_tiling or args.svg:
        raise ArgumentTypeError("--concurrent", args.concurrent, "a whole number of calls at once, at least 1 (and "
                                "without --vae-tiling or --svg, which a single call's dry run takes)")
    many = simulate_many(args.path, plan, [call] * args.concurrent, workers=args.concurrent, steps=args.steps)
    for report in many.reports:
        print(report)
    print(many)
    fits = not many.refused and all(report.fits for report in many.reports)  # a call too large: does not fit
    return 0 if many.ok and fits else 1


def _run(args) -> int:
    from .demo import generate

    _check_output(Path(args.output))
    options = {k: v for k, v in (("num_inference_steps", args.steps), ("height", args.height),
                                 ("width", args.width)) if v}
    return generate(_for_call(_request(args), {"prompt": args.prompt, **options}), args.prompt, args.seed, options,
                    Path(args.output))


def _for_call(request, call: dict):
    """``request`` planned for the call ``run`` makes, where the plan depends on a call (a measuring dry run,
    strategy "auto" or "parallel": its size, steps and guidance), not for the pipeline's default call."""
    from .api import PRICED_FOR_CALL

    return dataclasses.replace(request, call=call) if request.measured or request.strategy in PRICED_FOR_CALL \
        else request


def _serve(args) -> int:
    from .serve import Options
    from .serve.access import Access, is_local

    key = _api_key(args)
    local = is_local(args.host)
    if not local and not key:
        print(f"pipemap: WARNING: serving on {args.host}, reachable from other machines, with no API key: anyone "
              "who reaches the port can run the pipeline. Give --api-key-file (or PIPEMAP_API_KEY), or bind "
              "--host 127.0.0.1", file=sys.stderr, flush=True)
    options = Options(args.path, args.hardware, _strategy(args.strategy), args.dtype, args.variant,
                      _headroom(args.headroom),
                      args.max_queue, args.timeout, args.max_n, args.workers, args.max_steps, args.max_prompt,
                      tuple(args.served_model_name), Access(key, local, args.max_body),
                      args.max_batch, args.batch_window_ms / 1000, args.max_frames)
    if args.ray:
        return _serve_on_ray(args, options)
    from .serve import run
    from .serve.connections import ConnectionLimits
    from .serve.service import Loading

    def ready(service) -> None:
        print(service.plan)
        print(f"pipemap: ready on http://{args.host}:{args.port} (POST /v1/images/generations)", flush=True)

    loading = Loading(options, on_ready=ready)  # the port answers while it loads: /health/ready says when it is ready
    print(f"pipemap: loading {args.path}; serving on http://{args.host}:{args.port} (503 until loaded)", flush=True)
    run(loading, args.host, args.port, connections=ConnectionLimits(args.head_timeout, args.body_timeout,
                                                                    args.keep_alive, args.max_connections,
                                                                    args.max_head))
    if loading.failed is not None:
        raise loading.failed
    return 0


def _api_key(args) -> str | None:
    """The key from ``--api-key``, ``--api-key-file`` or ``PIPEMAP_API_KEY``, the first given; a key on the command
    line is warned about (``ps`` shows it to every user of the machine)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ArgumentConflictError("--api-key", "(hidden)", "--api-key-file", "(hidden)",
                                    "give the key one way: --api-key-file or PIPEMAP_API_KEY")
    if args.api_key:
        print("pipemap: WARNING: --api-key is visible to every user of this machine (ps, /proc): give it with "
              "--api-key-file PATH or PIPEMAP_API_KEY instead", file=sys.stderr, flush=True)
        return args.api_key
    if args.api_key_file is not None:
        return args.api_key_file  # the key read from the file (``_key_file``)
    return os.environ.get("PIPEMAP_API_KEY") or None


def _serve_on_ray(args, options) -> int:
    """``serve --ray``: deploy on Ray, or with ``--config-out`` write the Ray Serve config file instead."""
    if not args.ray_public and "RAY_ADDRESS" not in os.environ:  # read when ray is imported: before it is
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a local Ray's processes all on 127.0.0.1
    from .serve.deployment import RaySettings, run_on_ray

    settings = RaySettings(args.replicas, args.autoscale, args.replicas_per_node,
                           proxy_location=args.proxy_location, public=args.ray_public)
    if args.config_out:
        from .serve.ray_config import write_config

        print(f"wrote {write_config(options, settings, args.host, args.port, args.config_out)}: serve deploy it")
        return 0
    return run_on_ray(options, settings, args.host, args.port)


def _demo(args) -> int:
    from .demo import run_demo

    _check_output(Path(args.output))
    with tempfile.TemporaryDirectory(prefix="pipemap-demo-") as folder:
        return run_demo(Path(folder), args.hardware, _strategy(args.strategy), Path(args.output))


def _check_output(path: Path) -> None:
    """Before any work: ``path`` can be written as a file (its folders, made if missing, are folders)."""
    if path.is_dir():
        raise OutputPathError(str(path), "it is a folder")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise OutputPathError(str(path), f"{str(parent)!r} is a file, not a folder")


def _tiny_save(args) -> int:
    from . import tiny

    folder = Path(args.folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FolderNotEmptyError(str(folder))
    with quiet_progress():
        tiny.save(args.kind, folder)
    print(f"saved the tiny {args.kind} pipeline to {folder}; try: pipemap plan {folder} --hardware 2x5MiB,cpu=1GiB")
    return 0


def _catalog(args) -> int:
    from .catalog import run_catalog

    return run_catalog()


def _doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor()
