"""Every error pipemap raises (``pipemap.errors``): one base, ``ValueError`` for what the user gave, the data as
attributes, and a message that says what to do."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import pipemap
from pipemap import errors as E
from pipemap.errors import PipemapError, format_bytes

GIB = 2**30

# class -> (arguments, the attributes they become, words of the message that say what to do)
CASES = {
    E.MemorySpecError: (("lots",), {"text": "lots"}, ["'24GiB'", "integer number of bytes"]),
    E.HardwareSpecError: (("gpu0=1", "gpu0=1", "not a device name"),
                          {"spec": "gpu0=1", "part": "gpu0=1", "reason": "not a device name"},
                          ["not a device name", "2x24GiB,cpu=64GiB"]),
    E.UnknownDeviceError: (("cuda:3", ("cuda:0", "cpu")), {"device": "cuda:3", "available": ("cuda:0", "cpu")},
                           ["cuda:0, cpu", "Use one of them"]),
    E.UnknownComponentError: (("unett", ("unet", "vae")), {"component": "unett", "known": ("unet", "vae")},
                              ["unet, vae", "Fix the name"]),
    E.UnknownStrategyError: (("fastest", ("balanced", "auto")), {"strategy": "fastest", "known": ("balanced", "auto")},
                             ["balanced, auto", "a dict {component: device}"]),
    E.DoesNotFitError: (("unet", 3 * GIB, GIB, "balanced", ("balanced_split",), "cuda:1"),
                        {"component": "unet", "bytes": 3 * GIB, "largest_room": GIB, "strategy": "balanced",
                         "strategies": ("balanced_split",), "device": "cuda:1"},
                        ["3.00 GiB", "on cuda:1", "balanced_split", "max_memory="]),
    E.HostMemoryError: (("transformer", 20 * GIB, 16 * GIB, "auto"),
                        {"component": "transformer", "bytes": 20 * GIB, "largest_room": 16 * GIB, "strategy": "auto",
                         "strategies": (), "device": "cpu"},
                        ["20.00 GiB in RAM", "'transformer'", "16.00 GiB", "cpu= in the hardware spec"]),
    E.NotAPipelineError: (("/tmp/x", "no model_index.json"), {"path": "/tmp/x", "reason": "no model_index.json"},
                          ["no model_index.json", "save_pretrained"]),
    E.CheckpointError: (("/tmp/x.safetensors", "truncated"), {"path": "/tmp/x.safetensors", "reason": "truncated"},
                        ["truncated", "Re-download or re-save"]),
    E.ArgumentConflictError: (("dtype", "float16", "torch_dtype", "bfloat16"),
                              {"first": "dtype", "first_value": "float16", "second": "torch_dtype",
                               "second_value": "bfloat16"},
                              ["dtype='float16'", "torch_dtype='bfloat16'", "pass only one"]),
    E.PipelineMappedError: (("pipe.to('cuda')",), {"operation": "pipe.to('cuda')"}, ["pipemap.reset(pipe)"]),
    E.DispatchError: (("unet", "cuda:0", MemoryError("full")), {"component": "unet", "device": "cuda:0"},
                      ["MemoryError: full", "restored as it was", "re-plan"]),
    E.UnknownDtypeError: (("int8", "not a floating dtype"), {"dtype": "int8", "reason": "not a floating dtype"},
                          ["torch.float16", "'bfloat16'"]),
    E.PlanMismatchError: (("unet", "the pipeline has no unet"), {"component": "unet",
                                                                  "reason": "the pipeline has no unet"},
                          ["cannot dispatch 'unet'", "the pipeline has no unet"]),
    E.HeadroomError: ((2.5, "not in [0, 1)"), {"headroom": 2.5, "reason": "not in [0, 1)"}, ["'measure'", "'2GiB'"]),
    E.SimulationFailedError: ((SimpleNamespace(error="unet ran out"),), {}, ["unet ran out", "Fix the plan"]),
    E.ArgumentTypeError: (("hardware", 5, "a string or a Hardware"),
                          {"argument": "hardware", "value": 5, "expected": "a string or a Hardware"},
                          ["hardware=5 is a int", "give a string or a Hardware"]),
    E.PlanFormatError: (("the key 'devices' is missing",), {"reason": "the key 'devices' is missing"},
                        ["plan.to_json()", "Plan.from_json()"]),
    E.VariantNotFoundError: (("/tmp/sd", "fp8", ("fp16",)), {"path": "/tmp/sd", "variant": "fp8",
                                                             "available": ("fp16",)},
                             ["'fp8'", "fp16", "or no variant"]),
    E.CallArgumentError: (("FluxPipeline", ("negative_prompt",), ("prompt", "height")),
                          {"pipeline": "FluxPipeline", "names": ("negative_prompt",), "accepted": ("prompt", "height")},
                          ["'negative_prompt'", "prompt, height", "Fix or drop"]),
    E.OutputPathError: (("/tmp/f/out.png", "'/tmp/f' is a file, not a folder"),
                        {"path": "/tmp/f/out.png", "reason": "'/tmp/f' is a file, not a folder"},
                        ["cannot write '/tmp/f/out.png'", "is a file", "give a file path in a folder"]),
    E.FolderNotEmptyError: (("/tmp/out",), {"path": "/tmp/out"}, ["a new or empty one", "give another path"]),
    E.RunManyCallError: (("workers", 0, "give 1 or more"), {"argument": "workers", "value": 0, "fix": "give 1 or more"},
                         ["workers is 0", "give 1 or more"]),
    E.ForeignHookError: (("unet", "CpuOffload"), {"component": "unet", "hook": "CpuOffload"},
                         ["CpuOffload", "pipe.remove_all_hooks()", "pipemap.dispatch"]),
    E.CallTooLargeError: (("cuda:1", 3 * GIB, GIB, 16 * GIB, "VAE decode", ("at most 1 image",)),
                          {"device": "cuda:1", "needs": 3 * GIB, "room": GIB, "memory": 16 * GIB,
                           "phase": "VAE decode", "advice": ("at most 1 image",)},
                          ["3.00 GiB", "cuda:1", "VAE decode", "at most 1 image"]),
    E.ComponentChangedError: (("unet", "it needs 9 bytes", "pipemap.reset(pipe)"),
                              {"component": "unet", "reason": "it needs 9 bytes", "fix": "pipemap.reset(pipe)"},
                              ["'unet'", "it needs 9 bytes", "call pipemap.reset(pipe)"]),
    E.WeightsFileChangedError: (("/m/x.safetensors", "unet", "9 bytes became 3"),
                                {"path": "/m/x.safetensors", "component": "unet", "reason": "9 bytes became 3"},
                                ["'unet'", "9 bytes became 3", "put the file back", "rename it over the old one"]),
    E.WorkersOptionError: (("PIPEMAP_WORKERS", "mpi", ("thread", "process", "ray")),
                           {"variable": "PIPEMAP_WORKERS", "value": "mpi", "accepted": ("thread", "process", "ray"),
                            "why": "is not understood"},
                           ["PIPEMAP_WORKERS='mpi' is not understood", "one of thread, process, ray"]),
    E.RayPlacementError: (("unet", [{"CPU": 1.0, "GPU": 1.0}], {"CPU": 8.0}, 120.0),
                          {"component": "unet", "bundles": [{"CPU": 1.0, "GPU": 1.0}], "available": {"CPU": 8.0},
                           "timeout_s": 120.0},
                          ["workers of 'unet'", "{'CPU': 1.0, 'GPU': 1.0}", "all on one node", "within 120 s",
                           "{'CPU': 8.0} free", "PIPEMAP_WORKERS=process"]),
    E.WorkerDiedError: (("unet", "cuda:1", 42, "call", -9, None),
                        {"component": "unet", "device": "cuda:1", "pid": 42, "phase": "call", "exitcode": -9,
                         "timeout_s": None},
                        ["pid 42", "exited with code -9", "next call starts new ones", "PIPEMAP_WORKERS=thread"]),
    E.WorkerCallError: (("unet", "cuda:1", 42, "call", "Traceback...\nValueError: bad shape\n"),
                        {"component": "unet", "device": "cuda:1", "pid": 42, "phase": "call",
                         "remote_traceback": "Traceback...\nValueError: bad shape\n"},
                        ["ValueError: bad shape", ".remote_traceback", "PIPEMAP_WORKERS=thread"]),
    E.RanksSelfTestError: (("unet", ["cuda:0", "cuda:1"], "an all-reduce of known values gave [2.0], not 3.0"),
                           {"component": "unet", "devices": ["cuda:0", "cuda:1"],
                            "why": "an all-reduce of known values gave [2.0], not 3.0"},
                           ["'unet' on cuda:0, cuda:1", "gave [2.0], not 3.0", "ranks='thread'", "pipemap doctor"]),
    E.CannotTravelError: (("transformer", "MyProcessor is defined in the script's __main__"),
                          {"component": "transformer", "why": "MyProcessor is defined in the script's __main__"},
                          ["'transformer' cannot be sent to a worker process", "MyProcessor", "ranks='thread'"]),
    E.UnwaitedCopyError: (("unet.down_blocks.0", "cuda:0"), {"block": "unet.down_blocks.0", "device": "cuda:0"},
                          ["'unet.down_blocks.0'", "on cuda:0", "waited for (Queues.wait)"]),
    E.BufferReuseError: (("unet.up_blocks.1", "cuda:0"), {"block": "unet.up_blocks.1", "device": "cuda:0"},
                         ["'unet.up_blocks.1'", "pass the buffer's last-use event as `after`"]),
    E.DeviceMixError: (("aten.add.Tensor", ("meta:0", "meta:1")),
                       {"operation": "aten.add.Tensor", "devices": ("meta:0", "meta:1")},
                       ["aten.add.Tensor got tensors on meta:0, meta:1"]),
    E.StandInError: (("unet", "UNet2DConditionModel", ValueError("no such config key\nmore")),
                     {"component": "unet", "class_name": "UNet2DConditionModel"},
                     ["component 'unet' (UNet2DConditionModel)", "ValueError: no such config key)", "pipemap.load"]),
    E.UnknownValueError: (("aten._local_scalar_dense",), {"operation": "aten._local_scalar_dense"},
                          ["reads a value computed from weights", "run the pipeline for real (pipemap.load)"]),
    E.RequestError: (("n", "n is 9: ask for 1 to 4 images"),
                     {"param": "n", "message": "n is 9: ask for 1 to 4 images", "code": "invalid_value"},
                     ["ask for 1 to 4 images"]),
    E.ModelNotFoundError: (("sdxl", ("flux", "sd3")),
                           {"model": "sdxl", "names": ("flux", "sd3"), "param": "model", "code": "model_not_found"},
                           ["'sdxl' is not served here", "'flux', 'sd3'", "GET /v1/models"]),
    E.AutoscaleSpecError: (("4:1",), {"text": "4:1"}, ["--autoscale '4:1'", "MIN:MAX", "'1:4'"]),
    E.QueueFullError: ((16, 3), {"depth": 16, "retry_after": 3}, ["16 requests waiting", "retry in 3 s"]),
    E.DrainingError: ((), {}, ["shutting down", "send the request to another one"]),
    E.WorkDropped: ((7,), {"step": 7}, ["timed out", "after step 7"]),
}
# errors in what pipemap was asked to do at run time, not in what the user gave
RUNTIME = {E.PipelineMappedError, E.DispatchError, E.SimulationFailedError, E.ForeignHookError, E.WorkerDiedError,
           E.WorkerCallError, E.RayPlacementError, E.RanksSelfTestError, E.UnwaitedCopyError, E.BufferReuseError,
           E.DeviceMixError, E.StandInError, E.UnknownValueError}
# the service's own states (its queue full, shutting down, a timed-out request's work dropped): neither the user's
# input nor a failed run; HTTP answers them 429, 503 and 504
SERVICE = {E.QueueFullError, E.DrainingError, E.WorkDropped}
# reached through their wing, where they were defined before they moved here, not from ``pipemap`` itself
BY_WING = {E.UnwaitedCopyError: "runtime.streams", E.BufferReuseError: "runtime.streams",
           E.DeviceMixError: "dryrun.standin", E.StandInError: "dryrun.standin", E.UnknownValueError: "dryrun.known",
           E.RequestError: "serve", E.ModelNotFoundError: "serve.requests", E.AutoscaleSpecError: "serve.deployment",
           E.QueueFullError: "serve", E.DrainingError: "serve", E.WorkDropped: "serve"}
WARNINGS = {E.PipemapWarning, E.UnsafeTransferWarning, E.RanksFallbackWarning, E.DecimalSizeWarning}
# raised and caught inside pipemap, never seen by a user: no data, no advice
SIGNALS = {E.Unsplittable, E.BodyTooLarge, E.ClientGone}


def test_the_table_covers_every_error_of_the_module():
    defined = {c for _, c in inspect.getmembers(E, inspect.isclass)
               if issubclass(c, Exception) and c.__module__ == E.__name__}
    errors = {c for c in defined if issubclass(c, PipemapError)}
    assert errors - {PipemapError} == set(CASES)
    assert defined - errors == WARNINGS | SIGNALS  # and nothing else


def test_warnings_and_signals():
    assert issubclass(E.UnsafeTransferWarning, E.PipemapWarning) and issubclass(E.PipemapWarning, UserWarning)
    fallback = E.RanksFallbackWarning("transformer", "process", "MyProcessor is defined in the script's __main__")
    assert isinstance(fallback, E.PipemapWarning) and (fallback.component, fallback.runtime) == ("transformer",
                                                                                               "process")
    assert "runs its split ranks as threads, not as process workers: MyProcessor" in str(fallback)
    assert pipemap.PipemapWarning is E.PipemapWarning and pipemap.UnsafeTransferWarning is E.UnsafeTransferWarning
    assert not any(issubclass(c, (PipemapError, ValueError, RuntimeError)) for c in SIGNALS)


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_each_error_carries_its_data_and_says_what_to_do(cls):
    args, attributes, words = CASES[cls]
    error = cls(*args)
    assert isinstance(error, PipemapError)
    assert isinstance(error, ValueError) == (cls not in RUNTIME | SERVICE)
    if cls in RUNTIME:
        assert isinstance(error, RuntimeError)
    for name, value in attributes.items():
        assert getattr(error, name) == value, name
    for word in words:
        assert word in str(error), (word, str(error))
    with pytest.raises(cls):  # raisable, and caught by what the user catches
        raise error


def test_every_error_is_exported_by_the_package():
    assert pipemap.PipemapError is PipemapError
    missing = [c.__name__ for c in CASES if c not in BY_WING and getattr(pipemap, c.__name__, None) is not c]
    assert missing == [], missing


@pytest.mark.slow  # imports the dry run's and the service's modules (torch, diffusers, starlette): seconds
def test_errors_that_moved_here_stay_importable_where_they_were():
    wings = {cls: wing for cls, wing in BY_WING.items() if wing != "serve.deployment"}  # that one imports ray
    moved = {cls: getattr(importlib.import_module(f"pipemap.{wing}"), cls.__name__, None)
             for cls, wing in wings.items()}
    assert {cls: found for cls, found in moved.items() if found is not cls} == {}


def test_argument_type_error_is_a_type_error_too():
    assert issubclass(E.ArgumentTypeError, TypeError)


def test_dispatch_error_keeps_its_cause():
    cause = RuntimeError("CUDA out of memory")
    assert E.DispatchError("vae", "cuda:1", cause).cause is cause


def test_long_values_are_shortened_in_the_message():
    error = E.ArgumentConflictError("strategy", {f"component_{i}": "cuda:0" for i in range(20)}, "device_map", "auto")
    text = str(error)
    assert "..." in text and len(text) < 300 and "device_map='auto'" in text


def test_a_worker_silent_past_its_timeout_says_so():
    assert "gave no answer within 120 s" in str(E.WorkerDiedError("unet", "cuda:1", 42, "call", None, 120.0))


def test_unknown_device_error_without_devices_says_none():
    assert "the devices are none" in str(E.UnknownDeviceError("gpu", ()))


def test_does_not_fit_error_without_strategies_or_device():
    text = str(E.DoesNotFitError("unet", 100, 10, "balanced", ()))
    assert "on any GPU" in text and "no strategy fits it" in text


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * GIB, "3.00 GiB"),
                                         (1536 * 2**20, "1.50 GiB"), (-2048, "-2.00 KiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# ---- every exception and warning class of the package is defined in errors.py -----------------------------------

PACKAGE = Path(pipemap.__file__).parent
_BUILTIN = {name for name, value in vars(builtins).items()
            if isinstance(value, type) and issubclass(value, BaseException)}
# a class statement with bases: a file without one defines no exception (parsing only the others halves the time)
_DERIVED = re.compile(r"^[ \t]*class\s+\w+\s*\(", re.MULTILINE)


def _base_name(node: ast.expr) -> str:
    """The name a class base is written with: ``Exception``, ``errors.PipemapError`` -> ``PipemapError``."""
    if isinstance(node, ast.Subscript):
        return _base_name(node.value)
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _classes(node: ast.AST):
    """Every class statement below ``node``, at any depth: statements only are walked (a class is one), which skips
    the expressions, most of a file's nodes."""
    for child in getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "finalbody", []) + \
            getattr(node, "handlers", []) + getattr(node, "cases", []):
        if isinstance(child, ast.ClassDef):
            yield child
        yield from _classes(child)


def exceptions_outside_errors(package: Path) -> list[str]:
    """``file:Class`` of every class below ``package``, at any depth of a file, deriving from an exception or a
    warning (a builtin one, one of ``errors.py``, one named ``...Error``/``...Exception``/``...Warning`` such as
    torch's ``OutOfMemoryError``, or one of these classes) and not defined in the top-level ``errors.py``."""
    texts = {path: path.read_text() for path in sorted(package.rglob("*.py"))}
    classes = [(path, node) for path, text in texts.items() if _DERIVED.search(text)  # others define no subclass
               for node in _classes(ast.parse(text))]
    exceptional = set(_BUILTIN)
    grew = True
    while grew:  # a class deriving from one found: found, until nothing new is
        known = len(exceptional)
        exceptional |= {node.name for _, node in classes
                        if any(_base_name(b) in exceptional or _base_name(b).endswith(("Error", "Exception", "Warning"))
                               for b in node.bases)}
        grew = len(exceptional) > known
    return [f"{path.relative_to(package)}:{node.name}" for path, node in classes
            if node.name in exceptional and path != package / "errors.py"]


def test_every_exception_and_warning_is_defined_in_errors_py():
    assert exceptions_outside_errors(PACKAGE) == []


def test_the_walk_finds_an_exception_defined_elsewhere(tmp_path):
    (tmp_path / "errors.py").write_text("class PipemapError(Exception):\n    pass\n")
    (tmp_path / "wing").mkdir()
    (tmp_path / "wing" / "a.py").write_text(
        "import torch\nfrom ..errors import PipemapError\n\n"
        "class Mine(PipemapError):\n    pass\n\nclass Sub(Mine):\n    pass\n\n"
        "class Note(UserWarning):\n    pass\n\nclass Oom(torch.cuda.OutOfMemoryError):\n    pass\n\n"
        "class Plain:\n    pass\n\ndef f():\n    class Inner(KeyError):\n        pass\n")
    assert sorted(exceptions_outside_errors(tmp_path)) == [
        "wing/a.py:Inner", "wing/a.py:Mine", "wing/a.py:Note", "wing/a.py:Oom", "wing/a.py:Sub"]
