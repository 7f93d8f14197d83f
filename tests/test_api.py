"""Bad input, table-driven: each case a typed error whose message names what was wrong, and afterwards the
pipeline (every tensor, hook and attribute) and the files on disk exactly as they were.

A case is ``(id, make, error, fragment)``: ``make(ctx)`` prepares what the case needs (a corrupted copy of a tiny
pipeline folder, say) and returns the call that must fail.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import pipemap
from helpers import plain_pipeline
from pipemap.cli import main
from pipemap.hardware import Performance
from pipemap.modes import POOL_SLACK
from pipemap.units import parse_bytes

E = pipemap  # the error classes, short


@dataclass
class Ctx:
    folder: str  # the session's tiny SD folder (never written)
    sdxl: str
    pipe: object  # the tiny SD pipeline, loaded once
    plan: pipemap.Plan  # a valid plan of ``folder`` for "2x1GiB,cpu=4GiB"
    tmp: Path

    def copy(self) -> Path:
        """A copy of the tiny SD folder to corrupt."""
        return Path(shutil.copytree(self.folder, self.tmp / "copy"))


@pytest.fixture(scope="module")
def shared(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    plan = pipemap.plan(tiny_folders["sd"], hardware="2x1GiB,cpu=4GiB")
    return tiny_folders["sd"], tiny_folders["sdxl"], pipe, plan


# ---- helpers that corrupt a copied folder -----------------------------------------------------------------------


def unet_file(folder: Path) -> Path:
    return folder / "unet" / "diffusion_pytorch_model.safetensors"


def with_header(header, raw: bytes | None = None):
    def make(ctx: Ctx):
        folder = ctx.copy()
        for path in (folder / "unet").glob("*.safetensors"):
            path.unlink()
        body = raw if raw is not None else json.dumps(header).encode()
        unet_file(folder).write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 64)
        return lambda: pipemap.plan(str(folder), hardware="2x1GiB")
    return make


def with_index(weight_map, text: str | None = None):
    def make(ctx: Ctx):
        folder = ctx.copy()
        index = folder / "unet" / "diffusion_pytorch_model.safetensors.index.json"
        index.write_text(text if text is not None else json.dumps({"metadata": {}, "weight_map": weight_map}))
        return lambda: pipemap.plan(str(folder), hardware="2x1GiB")
    return make


def with_model_index(change):
    def make(ctx: Ctx):
        folder = ctx.copy()
        path = folder / "model_index.json"
        data = json.loads(path.read_text())
        result = change(data, folder)
        if result is not None:
            path.write_text(result if isinstance(result, str) else json.dumps(result))
        return lambda: pipemap.plan(str(folder), hardware="2x1GiB")
    return make


def drop(name: str):
    def change(data, folder):
        shutil.rmtree(folder / name)
    return change


def bin_only(data, folder):
    for path in (folder / "unet").glob("*.safetensors"):
        path.unlink()
    (folder / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\0" * 16)


def edit(**entries):
    def change(data, folder):
        return {**data, **entries}
    return change


def call(function, *args, **kwargs):
    return lambda ctx: (lambda: function(*args, **kwargs))


def on_folder(**kwargs):
    return lambda ctx: (lambda: pipemap.plan(ctx.folder, **{"hardware": "2x1GiB,cpu=4GiB", **kwargs}))


def saved(change):
    """``Plan.from_json`` of the valid plan's JSON after ``change(dict)``."""
    def make(ctx: Ctx):
        data = json.loads(ctx.plan.to_json())
        change(data)
        return lambda: pipemap.Plan.from_json(json.dumps(data))
    return make


def setting(path: str, value):
    def change(data):
        *keys, last = path.split("/")
        target = data
        for key in keys:
            target = target[next(iter(target)) if key == "*" else key]
        target[last] = value
    return change


def removing(path: str):
    def change(data):
        *keys, last = path.split("/")
        target = data
        for key in keys:
            target = target[next(iter(target)) if key == "*" else key]
        del target[last]
    return change


def load_with(**kwargs):
    return lambda ctx: (lambda: pipemap.load(ctx.folder, **{"plan": ctx.plan, **kwargs}))


def cli(*argv):
    """The command line in process: exit code 2 and ``pipemap: error: ...`` on stderr, no traceback."""
    def make(ctx: Ctx):
        def run():
            args = [a.replace("FOLDER", ctx.folder).replace("TMP", str(ctx.tmp)) for a in argv]
            try:
                code = main(args)
            except SystemExit as exit:  # argparse's own errors
                code = exit.code
            raise CliExit(code)
        return run
    return make


class CliExit(Exception):
    def __init__(self, code):
        self.code = code


def truncated(ctx: Ctx) -> Path:
    """A copy whose UNet weights file lost its last bytes (an interrupted download)."""
    folder = ctx.copy()
    path = unet_file(folder)
    path.write_bytes(path.read_bytes()[:-100])
    return folder


def unknown_class(ctx: Ctx) -> Path:
    folder = ctx.copy()
    path = folder / "model_index.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "unet": ["diffusers", "NoSuchUNet"]}))
    return folder


def loading(corrupt):
    return lambda ctx: (lambda folder: lambda: pipemap.load(str(folder), hardware="2x1GiB,cpu=4GiB"))(corrupt(ctx))


def planning(corrupt):
    return lambda ctx: (lambda folder: lambda: pipemap.plan(str(folder), hardware="2x1GiB"))(corrupt(ctx))


def cli_run(corrupt):
    """``pipemap run`` on a corrupted copy of the folder."""
    def make(ctx: Ctx):
        folder = corrupt(ctx)
        return cli("run", str(folder), "--prompt", "a cat", "--output", "TMP/out.png")(ctx)
    return make


def simulating(**kwargs):
    return lambda ctx: lambda: pipemap.simulate(ctx.pipe, ctx.plan, **kwargs)


def output_under_file(ctx: Ctx):
    (ctx.tmp / "file.txt").write_text("mine")
    return cli("run", "FOLDER", "--prompt", "a cat", "--output", "TMP/file.txt/out.png")(ctx)


def nonempty(ctx: Ctx):
    (ctx.tmp / "full").mkdir()
    (ctx.tmp / "full" / "keep.txt").write_text("mine")
    return cli("tiny", "save", "sd", "TMP/full")(ctx)


# ---- the cases ------------------------------------------------------------------------------------------------

CASES = [
    # memory sizes
    *[(f"bytes-{v!r}", call(parse_bytes, v), E.MemorySpecError, "as a memory size")
      for v in ("12XB", "-1", -5, 1.5, None, True, "", "1e9", "２GiB", "1 2GiB", "GiB", "1.5.2GB")],
    # device names
    *[(f"device-{v!r}", call(pipemap.normalize_device, v), E.UnknownDeviceError, "device")
      for v in ("gpu", "cuda:-1", "cuda:1:2", "cuda:١", "cpu:1", 1.5, None, [], -1, True, "cuda 0", "")],
    *[(f"device-type-{v}", call(pipemap.normalize_device, v), E.UnknownDeviceError, "pipemap does not run on")
      for v in ("mps", "xpu:0", "npu:1", "hpu")],
    # hardware specs
    *[(f"spec-{v!r}", call(pipemap.Hardware.parse, v), E.HardwareSpecError, frag) for v, frag in (
        ("", "no device"), (",", "no device"), ("cuda:0", "NAME=SIZE"), ("cuda:0=", "memory size"),
        ("cuda:0=abc", "memory size"), ("cuda:0=1GiB,cuda:0=2GiB", "given twice"), ("1000000x1GiB", "COUNT"),
        ("0x1GiB", "COUNT"), ("meta:0=1GiB", "stand-in"), ("mps=1GiB", "does not run on"),
        ("2x24GiB,flops=0", "above zero"), ("2x24GiB,flops=-1T", "FLOP/s"), ("2x24GiB,flops=abc", "FLOP/s"),
        ("2x24GiB,host_bw=0", "above zero"), ("2x24GiB,peer_bw=0GB", "above zero"), ("x=1", "not a device"),
        ("cuda:١=1GiB", "not a device"), ("2x24GiB,cpu=lots", "memory size"))],
    ("spec-not-a-string", call(pipemap.Hardware.parse, 5), E.ArgumentTypeError, "hardware=5"),
    *[(f"performance-{k}-{v!r}", call(Performance, **{k: v}), E.HardwareSpecError, "positive finite")
      for k, v in (("flops", 0), ("host_bandwidth", -1.0), ("peer_bandwidth", float("nan")),
                   ("cpu_flops", float("inf")), ("flops", "fast"))],
    # plan() arguments
    ("hardware-int", on_folder(hardware=5), E.ArgumentTypeError, "hardware=5"),
    ("hardware-list", on_folder(hardware=["2x1GiB"]), E.ArgumentTypeError, "a spec string"),
    ("max-memory-str", on_folder(max_memory="20GiB"), E.ArgumentTypeError, "max_memory"),
    ("max-memory-size", on_folder(max_memory={0: "abc"}), E.MemorySpecError, "'abc'"),
    ("max-memory-meta", on_folder(max_memory={"meta:0": "1GiB"}), E.UnknownDeviceError, "stand-in"),
    ("max-memory-missing-gpu", on_folder(max_memory={5: "1GiB"}), E.UnknownDeviceError, "cuda:5"),
    ("strategy-name", on_folder(strategy="fastest"), E.UnknownStrategyError, "balanced_split"),
    ("strategy-int", on_folder(strategy=5), E.UnknownStrategyError, "5"),
    ("strategy-device", on_folder(strategy={"unet": "cuda:9"}), E.UnknownDeviceError, "cuda:9"),
    ("strategy-component", on_folder(strategy={"nope": "cuda:0"}), E.UnknownComponentError, "'nope'"),
    ("strategy-meta", on_folder(strategy={"unet": "meta:0"}), E.UnknownDeviceError, "stand-in"),
    ("strategy-mps", on_folder(strategy={"unet": "mps"}), E.UnknownDeviceError, "does not run on"),
    ("strategy-key", on_folder(strategy={0: "cuda:0"}), E.ArgumentTypeError, "component name"),
    ("strategy-conflict", on_folder(strategy="balanced", device_map="sequential"), E.ArgumentConflictError,
     "device_map"),
    *[(f"dtype-{v}", on_folder(dtype=v), E.UnknownDtypeError, frag) for v, frag in (
        ("int8", "floating dtype"), (torch.int32, "floating dtype"), (torch.bool, "floating dtype"),
        (torch.complex64, "floating dtype"), (torch.float8_e4m3fn, "16 bits"), ("float17", "no such dtype"),
        (5, "not a dtype"), ("uint8", "floating dtype"))],
    ("dtype-conflict", on_folder(dtype=torch.float16, torch_dtype=torch.bfloat16), E.ArgumentConflictError,
     "torch_dtype"),
    ("variant-missing", on_folder(variant="fp8"), E.VariantNotFoundError, "fp16"),
    ("variant-int", on_folder(variant=16), E.ArgumentTypeError, "variant=16"),
    *[(f"headroom-{v!r}", on_folder(headroom=v), E.HeadroomError, frag) for v, frag in (
        (1.5, "below 1"), (-0.1, "below 1"), ("2 apples", "memory size"), (True, "no headroom"),
        ([0.1], "no headroom"), ("1.5", "below 1"), (float("nan"), "below 1"), ({"cuda:0": "lots"}, "memory size"),
        ("-2GiB", "memory size"))],
    ("headroom-device", on_folder(headroom={"cuda:7": 0.1}), E.UnknownDeviceError, "cuda:7"),
    ("headroom-meta", on_folder(headroom={"meta:0": 0.1}), E.UnknownDeviceError, "stand-in"),
    ("headroom-measure-inventory", lambda ctx: lambda: pipemap.plan(pipemap.inspect(ctx.folder), hardware="2x1GiB",
                                                                    headroom="measure"), E.HeadroomError, "Inventory"),
    ("call-without-measure", on_folder(call={"height": 32}), E.ArgumentConflictError, "measure"),
    ("source-int", call(pipemap.plan, 5, hardware="2x1GiB"), E.NotAPipelineError, "expected a folder"),
    ("source-missing", call(pipemap.plan, "/no/such/folder", hardware="2x1GiB"), E.NotAPipelineError,
     "no such folder"),
    ("does-not-fit", on_folder(hardware="2x1KiB,cpu=1GiB"), E.DoesNotFitError, "needs"),
    # safetensors headers
    ("header-list", with_header([1, 2]), E.CheckpointError, "JSON list"),
    ("header-negative", with_header({"w": {"dtype": "F32", "shape": [-4, 2], "data_offsets": [0, 0]}}),
     E.CheckpointError, "malformed"),
    ("header-float", with_header({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 0]}}),
     E.CheckpointError, "malformed"),
    ("header-string", with_header({"w": {"dtype": "F32", "shape": ["3"], "data_offsets": [0, 0]}}),
     E.CheckpointError, "malformed"),
    ("header-bool", with_header({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 0]}}),
     E.CheckpointError, "malformed"),
    ("header-shape-dict", with_header({"w": {"dtype": "F32", "shape": {"a": 1}}}), E.CheckpointError, "malformed"),
    ("header-dtype", with_header({"w": {"dtype": "F33", "shape": [1]}}), E.CheckpointError, "malformed"),
    ("header-entry", with_header({"w": 5}), E.CheckpointError, "malformed"),
    ("header-json", with_header(None, raw=b"{not json"), E.CheckpointError, "not valid JSON"),
    ("header-utf8", with_header(None, raw=b"\xff\xfe"), E.CheckpointError, "not valid JSON"),
    # shard indexes
    ("index-list", with_index(["a.safetensors"]), E.CheckpointError, "weight_map"),
    ("index-int-values", with_index({"w": 5}), E.CheckpointError, "weight_map"),
    ("index-int-keys", with_index(None, text='{"weight_map": {"1": null}}'), E.CheckpointError, "weight_map"),
    ("index-escape", with_index({"w": "../vae/diffusion_pytorch_model.safetensors"}), E.CheckpointError,
     "weight_map"),
    ("index-json", with_index(None, text="{nope"), E.CheckpointError, "unreadable"),
    ("index-no-map", with_index(None, text='{"metadata": {}}'), E.CheckpointError, "unreadable"),
    ("index-missing-shard", with_index({"w": "gone.safetensors"}), E.CheckpointError, "missing"),
    # model_index.json
    ("model-index-gone", with_model_index(lambda d, f: (f / "model_index.json").unlink()), E.NotAPipelineError,
     "no model_index.json"),
    ("model-index-json", with_model_index(lambda d, f: "{nope"), E.NotAPipelineError, "not valid JSON"),
    ("model-index-class", with_model_index(lambda d, f: {k: v for k, v in d.items() if k != "_class_name"}),
     E.NotAPipelineError, "_class_name"),
    ("model-index-list", with_model_index(lambda d, f: "[1, 2]"), E.NotAPipelineError, "_class_name"),
    ("library-unknown", with_model_index(edit(unet=["nosuchlib", "UNet"])), E.NotAPipelineError, "nosuchlib"),
    ("library-int", with_model_index(edit(unet=[5, "UNet"])), E.NotAPipelineError, "not [library, class name]"),
    ("subfolder-missing", with_model_index(drop("unet")), E.NotAPipelineError, "no subfolder unet/"),
    ("bin-only", with_model_index(bin_only), E.CheckpointError, ".bin"),
    # saved plans
    ("json-bad", lambda ctx: lambda: pipemap.Plan.from_json("{nope"), E.PlanFormatError, "not valid JSON"),
    ("json-list", lambda ctx: lambda: pipemap.Plan.from_json("[]"), E.PlanFormatError, "not a JSON object"),
    ("json-empty", lambda ctx: lambda: pipemap.Plan.from_json("{}"), E.PlanFormatError, "missing"),
    ("json-int", lambda ctx: lambda: pipemap.Plan.from_json(5), E.PlanFormatError, "JSON text"),
    ("json-no-components", saved(removing("components")), E.PlanFormatError, "'components' is missing"),
    ("json-no-devices", saved(removing("devices")), E.PlanFormatError, "'devices' is missing"),
    ("json-no-strategy", saved(removing("strategy")), E.PlanFormatError, "'strategy' is missing"),
    ("json-no-execution", saved(removing("execution_device")), E.PlanFormatError, "missing"),
    ("json-empty-components", saved(setting("components", {})), E.PlanFormatError, "no component"),
    ("json-mode", saved(setting("components/*/mode", "teleport")), E.PlanFormatError, "teleport"),
    ("json-device", saved(setting("components/*/device", "gpu:0")), E.PlanFormatError, "not a device name"),
    ("json-meta", saved(setting("components/*/device", "meta:0")), E.PlanFormatError, "stand-in"),
    ("json-bytes-negative", saved(setting("components/*/bytes", -5)), E.PlanFormatError, "whole number"),
    ("json-bytes-string", saved(setting("components/*/bytes", "10")), E.PlanFormatError, "whole number"),
    ("json-bytes-bool", saved(setting("components/*/bytes", True)), E.PlanFormatError, "whole number"),
    ("json-device-elsewhere", saved(setting("components/*/device", "cuda:5")), E.PlanFormatError, "not among"),
    ("json-shards", saved(setting("components/*/shards", {"down_blocks.0": {"device": "cuda:1", "bytes": 1}})),
     E.PlanFormatError, "shards"),
    ("json-notes", saved(setting("notes", "hello")), E.PlanFormatError, "notes"),
    ("json-budget", saved(setting("devices/*/budget", "big")), E.PlanFormatError, "whole number"),
    ("json-strategy-type", saved(setting("strategy", 5)), E.PlanFormatError, "not a string"),
    # dispatch and reset
    ("dispatch-str-pipe", lambda ctx: lambda: pipemap.dispatch("pipe", ctx.plan), E.ArgumentTypeError,
     "DiffusionPipeline"),
    ("dispatch-str-plan", lambda ctx: lambda: pipemap.dispatch(ctx.pipe, "balanced"), E.ArgumentTypeError,
     "pipemap.Plan"),
    ("dispatch-dict-plan", lambda ctx: lambda: pipemap.dispatch(ctx.pipe, ctx.plan.to_dict()), E.ArgumentTypeError,
     "pipemap.Plan"),
    ("dispatch-other-pipeline", lambda ctx: lambda: pipemap.dispatch(ctx.pipe, pipemap.plan(ctx.sdxl,
                                                                                            hardware="2x1GiB")),
     E.PlanMismatchError, "text_encoder_2"),
    ("dispatch-meta", lambda ctx: lambda: pipemap.dispatch(ctx.pipe, ctx.plan.remap({"cuda:0": "meta:0",
                                                                                     "cuda:1": "meta:1"})),
     E.PlanMismatchError, "stand-in"),
    ("reset-str", call(pipemap.reset, "pipe"), E.ArgumentTypeError, "reset(pipe)"),
    ("reset-none", call(pipemap.reset, None), E.ArgumentTypeError, "reset(pipe)"),
    # load
    ("load-int", call(pipemap.load, 5), E.ArgumentTypeError, "path=5"),
    ("load-plan-str", lambda ctx: lambda: pipemap.load(ctx.folder, plan="balanced"), E.ArgumentTypeError,
     "pipemap.Plan"),
    ("load-strategy", load_with(strategy="sequential"), E.ArgumentConflictError, "strategy='sequential'"),
    ("load-map", load_with(strategy={"unet": "cpu"}), E.ArgumentConflictError, "settles"),
    ("load-device-map", load_with(device_map="balanced_split"), E.ArgumentConflictError, "balanced_split"),
    ("load-hardware", load_with(hardware="2x9GiB,cpu=4GiB"), E.ArgumentConflictError, "hardware"),
    ("load-max-memory", load_with(max_memory={0: "3GiB"}), E.ArgumentConflictError, "max_memory"),
    ("load-dtype", load_with(dtype="float16"), E.ArgumentConflictError, "dtype"),
    ("load-variant", load_with(variant="fp16"), E.ArgumentConflictError, "variant"),
    ("load-headroom", load_with(headroom=0.2), E.ArgumentConflictError, "headroom"),
    ("load-other-pipeline", lambda ctx: lambda: pipemap.load(ctx.folder, plan=pipemap.plan(ctx.sdxl,
                                                                                          hardware="2x1GiB")),
     E.PlanMismatchError, "re-plan from this folder"),
    ("load-meta-plan", lambda ctx: lambda: pipemap.load(ctx.folder, plan=ctx.plan.remap({"cuda:0": "meta:0"})),
     E.UnknownDeviceError, "not on this machine"),
    ("load-missing", call(pipemap.load, "/no/such/folder"), E.NotAPipelineError, "no such folder"),
    # a component passed in built that is not of the kind model_index.json names: diffusers' check, typed, up front
    ("load-unet-str", lambda ctx: lambda: pipemap.load(ctx.folder, unet="not a module"), E.ArgumentTypeError,
     "unet='not a module' is a str: give a built component of the kind model_index.json names for 'unet'"),
    ("load-unet-linear", lambda ctx: lambda: pipemap.load(ctx.folder, unet=torch.nn.Linear(2, 2)),
     E.ArgumentTypeError, "an instance of diffusers.models.modeling_utils.ModelMixin"),
    ("load-scheduler-str", lambda ctx: lambda: pipemap.load(ctx.folder, scheduler="ddim"), E.ArgumentTypeError,
     "SchedulerMixin"),
    ("load-strategy-name", lambda ctx: lambda: pipemap.load(ctx.folder, strategy="nope"), E.UnknownStrategyError,
     "nope"),
    ("load-variant-missing", lambda ctx: lambda: pipemap.load(ctx.folder, variant="fp8"), E.VariantNotFoundError,
     "fp8"),
    ("load-truncated", loading(truncated), E.CheckpointError, "truncated"),
    ("load-unknown-class", loading(unknown_class), E.NotAPipelineError, "NoSuchUNet"),
    ("plan-unknown-class", planning(unknown_class), E.NotAPipelineError, "NoSuchUNet"),
    # the dry run's call
    ("simulate-keyword", lambda ctx: lambda: pipemap.simulate(ctx.pipe, ctx.plan, heigth=32), E.CallArgumentError,
     "heigth"),
    *[(f"simulate-steps-{v!r}", simulating(steps=v), E.ArgumentTypeError, "steps") for v in (-1, 0, 1.5, True, "2")],
    # a plan for another pipeline: refused before a dry run builds anything, whatever the source
    ("simulate-other-folder", lambda ctx: lambda: pipemap.simulate(ctx.folder, pipemap.plan(ctx.sdxl,
                                                                                          hardware="2x1GiB")),
     E.PlanMismatchError, "'text_encoder_2': the plan places it but the folder has no such model"),
    ("simulate-other-pipe", lambda ctx: lambda: pipemap.simulate(ctx.pipe, pipemap.plan(ctx.sdxl, hardware="2x1GiB")),
     E.PlanMismatchError, "re-plan from this pipeline"),
    ("simulate-other-catalog", lambda ctx: lambda: pipemap.simulate("flux.1-dev", ctx.plan), E.PlanMismatchError,
     "'text_encoder_2': the pipeline 'flux.1-dev' has this model but the plan does not place it"),
    ("simulate-many-other", lambda ctx: lambda: pipemap.simulate_many("flux.1-dev", ctx.plan, [{}]),
     E.PlanMismatchError, "made for another pipeline"),
    # the command line
    ("cli-strategy-json", cli("plan", "FOLDER", "--strategy", "{bad"), CliExit, "not valid JSON"),
    ("cli-headroom-json", cli("plan", "FOLDER", "--headroom", "{bad"), CliExit, "not valid JSON"),
    ("cli-headroom-fraction", cli("plan", "FOLDER", "--headroom", "1.5"), CliExit, "below 1"),
    ("cli-headroom-size", cli("plan", "FOLDER", "--headroom", "2 apples"), CliExit, "memory size"),
    ("cli-headroom-device", cli("plan", "FOLDER", "--hardware", "2x1GiB", "--headroom", '{"cuda:5": 0.1}'), CliExit,
     "cuda:5"),
    ("cli-hardware-count", cli("plan", "FOLDER", "--hardware", "1000000x1GiB"), CliExit, "COUNT"),
    ("cli-hardware-meta", cli("plan", "FOLDER", "--hardware", "meta:0=1GiB"), CliExit, "stand-in"),
    ("cli-dtype", cli("plan", "FOLDER", "--dtype", "int8"), CliExit, "floating dtype"),
    ("cli-variant", cli("plan", "FOLDER", "--variant", "fp8"), CliExit, "fp8"),
    ("cli-path", cli("plan", "/no/such/folder"), CliExit, "no such folder"),
    ("cli-strategy", cli("plan", "FOLDER", "--strategy", "nope"), CliExit, "unknown strategy"),
    ("cli-strategy-device", cli("plan", "FOLDER", "--strategy", '{"unet": "mps"}'), CliExit, "does not run on"),
    ("cli-tiny-kind", cli("tiny", "save", "sd3", "TMP/new"), CliExit, "invalid choice"),
    ("cli-tiny-nonempty", nonempty, CliExit, "not an empty folder"),
    ("cli-run-dtype", cli("run", "FOLDER", "--prompt", "a cat", "--dtype", "complex64"), CliExit, "floating dtype"),
    ("cli-simulate-headroom", cli("simulate", "FOLDER", "--headroom", "-1"), CliExit, "memory size"),
    ("cli-simulate-steps", cli("simulate", "FOLDER", "--hardware", "2x1GiB", "--steps", "-1"), CliExit, "steps"),
    ("cli-run-truncated", cli_run(truncated), CliExit, "truncated"),
    ("cli-run-unknown-class", cli_run(unknown_class), CliExit, "NoSuchUNet"),
    ("cli-run-output-under-file", output_under_file, CliExit, "is a file"),
    ("cli-demo-output-folder", cli("demo", "--output", "TMP"), CliExit, "it is a folder"),
    ("cli-no-command", cli(), CliExit, "required"),
]


def pipeline_state(pipe) -> dict:
    slots = {"pipe": sorted(pipe.__dict__)}
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            for path, sub in module.named_modules():
                for store in ("_parameters", "_buffers"):
                    for key, tensor in getattr(sub, store).items():
                        slots[(name, path, key)] = (id(tensor), getattr(tensor, "device", None),
                                                    None if tensor is None else float(tensor.detach().float().sum()))
                slots[(name, path)] = (getattr(sub, "_hf_hook", None), sorted(sub.__dict__))
    return slots


def files_state(*roots) -> dict:
    return {str(p): hashlib.sha1(p.read_bytes()).hexdigest() for root in roots for p in sorted(Path(root).rglob("*"))
            if p.is_file()}


def test_enough_cases():
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("make", "error", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(make, error, fragment, shared, tmp_path, capsys):
    folder, sdxl, pipe, plan = shared
    ctx = Ctx(folder, sdxl, pipe, plan, tmp_path)
    act = make(ctx)
    pipe_before, files_before = pipeline_state(pipe), files_state(folder, tmp_path)
    with pytest.raises(error) as caught:
        act()
    if error is CliExit:
        err = capsys.readouterr().err
        assert caught.value.code == 2
        assert fragment in err and "Traceback" not in err
        assert err.startswith(("pipemap: error:", "usage: pipemap"))
    else:
        assert fragment in str(caught.value)
        assert isinstance(caught.value, pipemap.PipemapError)
        if not isinstance(caught.value, (E.DispatchError, E.PipelineMappedError)):
            assert isinstance(caught.value, ValueError)  # input errors are also ValueErrors
    assert pipeline_state(pipe) == pipe_before
    assert files_state(folder, tmp_path) == files_before


@pytest.mark.parametrize(("name", "canonical"), [("cuda:01", "cuda:1"), (" CUDA:002 ", "cuda:2"), ("cpu:0", "cpu"),
                                                 (3, "cuda:3"), (torch.device("cuda", 1), "cuda:1")])
def test_device_names_are_canonical(name, canonical):
    assert pipemap.normalize_device(name) == canonical


@pytest.mark.parametrize(("headroom", "budget"), [("0.25", 750), (0.25, 750), ("100", 900), (100, 900),
                                                  ("1KB", 0), ({"cuda:0": "0.5"}, 500)])
def test_headroom_strings_read_as_the_api_takes_them(headroom, budget):
    from pipemap.planner import budgets

    assert budgets(pipemap.Hardware.parse("cuda:0=1000,cpu=5000"), headroom)["cuda:0"] == budget


def test_cli_headroom_takes_what_the_api_takes(tiny_folders, capsys):
    assert main(["plan", tiny_folders["sd"], "--hardware", "cuda:0=1GiB,cpu=4GiB", "--headroom", "0.5",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"]["cuda:0"]["budget"] == 2**29 - POOL_SLACK
    assert main(["plan", tiny_folders["sd"], "--hardware", "cuda:0=1GiB,cpu=4GiB", "--headroom",
                 '{"cuda:0": "256MiB"}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"]["cuda:0"]["budget"] == 3 * 2**28 - POOL_SLACK


@pytest.mark.slow
def test_two_placed_pipelines_admit_their_requests_on_one_ledger():
    # two tiny SD pipelines on the same tight GPU (remapped onto the CPU): run_many on both at once admits their
    # requests on one ledger, so together they never hold more than the GPU's room: two requests at once in all,
    # where a ledger each would admit two each (issue 39)
    import threading

    from pipemap import tiny
    from pipemap.api import memory_for

    plan = pipemap.plan(tiny.build("sd"), hardware="cuda:0=5MiB,cuda:1=4MiB,cpu=1GiB", headroom=0.0)
    pipes = [tiny.build("sd") for _ in range(2)]
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
        pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    admissions = [memory_for(pipe, plan) for pipe in pipes]
    assert admissions[0] is not None and admissions[1] is not None
    views = [admission.ledger for admission in admissions]
    ledger = views[0].shared
    assert views[1].shared is ledger and views[0] is not views[1]
    calls = [dict(prompt=f"a tiny cat number {i}", num_inference_steps=2, height=32, width=32, output_type="np")
             for i in range(3)]
    threads = [threading.Thread(target=pipemap.run_many, args=(pipe, calls), kwargs={"workers": 4, "plan": plan})
               for pipe in pipes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    memory = {d.device: d.memory for d in plan.devices}
    # each pipeline's own history: its requests and component calls, each record the shared ledger's totals
    assert [len(view.history) for view in views] == [3 * (1 + 2 + 2 + 1)] * 2
    history = [record for view in views for record in view.history]
    assert all(total <= memory[d] for record in history for d, total in record.total.items())
    assert max(r.running for r in history) == 2 and ledger.held() == {d: 0 for d in ledger.memory}
    pipemap.reset(pipes[1])  # its admission leaves the ledger with its pipeline's placement
    ledger.room("cuda:0")  # the rooms read again: the members still placed
    assert admissions[1] not in ledger.members and admissions[0] in ledger.members
    pipemap.reset(pipes[0])
