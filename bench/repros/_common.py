"""Shared by the round-4 scenario scripts: tiny pipelines, plans for two GPUs, plain-diffusers references, verdicts.

Two ways to run a two-GPU plan on a machine without a GPU:
- "cpu":  the plan remapped onto the CPU (`plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"})`), as pipemap's tests do;
          every device is the CPU, so a tensor left on the wrong device does not fail.
- "fake": pipemap's own fake CUDA (tests/fakecuda.py, two GPUs): a tensor on cuda:N wraps CPU data, kernels run on
          the CPU, and mixing devices raises as on a real GPU. The plan is used as made, with its cuda:N devices.

Each script prints `RESULT | scenario | mode | plain diffusers | pipemap | max abs diff / error | verdict` lines, then
PASS (every row as diffusers) or FAIL.

Environment: PIPEMAP_REPO (default: the current folder, the project root) for tests/families.py and tests/fakecuda.py; peft for LoRA scripts.
Run from the project root with its venv, e.g.  .venv/bin/python ../shared/context/user-scenarios-round4/repro_callback_change_parallel.py
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PIPEMAP_CACHE_DIR", os.path.join(tempfile.gettempdir(), "pipemap-us4-cache"))
REPO = os.environ.get("PIPEMAP_REPO", os.getcwd())
sys.path.insert(0, os.path.join(REPO, "tests"))

import warnings  # noqa: E402

warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from diffusers.utils import logging as dlog  # noqa: E402

import pipemap  # noqa: E402
from pipemap import tiny  # noqa: E402

torch.set_num_threads(1)
dlog.set_verbosity_error()
dlog.disable_progress_bar()
try:
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
except Exception:  # pragma: no cover
    pass

ON_CPU = {f"cuda:{i}": "cpu" for i in range(4)}
WORK = os.environ.get("US4_WORK") or os.path.join(tempfile.gettempdir(), "pipemap-us4-work")
os.makedirs(WORK, exist_ok=True)
TOL = 1e-4

# budgets that make the denoiser resident / offloaded / streamed / copied on a 2-GPU plan (round 3's, checked again)
HW = {
    "sd": {"balanced": "2x5MiB,cpu=1GiB", "balanced_low_memory": "cuda:0=4MiB,cuda:1=1MiB,cpu=1GiB",
           "balanced_ultra_low_memory": "2x2MiB,cpu=1GiB", "parallel": "2x8MiB,cpu=1GiB"},
    "flux": {"balanced": "2x4MiB,cpu=1GiB", "balanced_low_memory": "cuda:0=1MiB,cuda:1=256KiB,cpu=1GiB",
             "balanced_ultra_low_memory": "2x512KiB,cpu=1GiB", "parallel": "2x8MiB,cpu=1GiB"},
    "wan_t2v": {"balanced": "2x1MiB,cpu=1GiB", "parallel": "2x8MiB,cpu=1GiB",
                "balanced_low_memory": "cuda:0=160KiB,cuda:1=64KiB,cpu=1GiB",
                "balanced_ultra_low_memory": "2x96KiB,cpu=1GiB"},
    "qwen_image": {"balanced": "2x40MiB,cpu=1GiB", "parallel": "2x40MiB,cpu=1GiB"},
}
HW["sdxl"] = HW["controlnet"] = HW["sd"]
STRATEGIES = ("balanced", "balanced_low_memory", "balanced_ultra_low_memory", "parallel")
FAMILY = ("wan_t2v", "qwen_image")  # built by tests/families.py


def folder(kind: str) -> str:
    path = os.path.join(WORK, f"tiny-{kind}")
    if not os.path.exists(os.path.join(path, "model_index.json")):
        if kind in FAMILY:
            import families

            pipe, _ = families.build(kind)
            pipe.save_pretrained(path)
        else:
            tiny.save(kind, path)
    return path


def call_of(kind: str, pipe=None, **over) -> dict:
    """A small deterministic call of the tiny ``kind`` pipeline (a fresh generator each time)."""
    if kind in FAMILY:
        import families

        _, call = families.true_cfg(kind, 2) if kind == "wan_t2v" else families.build(kind)
        call = dict(call, num_inference_steps=2)
        if kind == "qwen_image":
            call = dict(call, max_sequence_length=200)
        call["generator"] = torch.Generator().manual_seed(0)
    else:
        call = tiny.default_call(pipe, kind)
    call.update(over)
    return call


def plain(kind: str, **kw):
    pipe = DiffusionPipeline.from_pretrained(folder(kind), **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def plan_for(kind: str, strategy: str, hardware: str | None = None, **kw):
    return pipemap.plan(folder(kind), hardware=hardware or HW[kind][strategy], strategy=strategy, **kw)


def placed(kind: str, strategy: str, mode: str = "cpu", hardware: str | None = None, **kw):
    """pipemap.load of the tiny ``kind`` folder onto a two-GPU plan: remapped onto the CPU ("cpu"), or as made, on
    the fake CUDA ("fake", which must be installed)."""
    plan = plan_for(kind, strategy, hardware)
    use = plan.remap(ON_CPU) if mode == "cpu" else plan
    pipe = pipemap.load(folder(kind), plan=use, progress=False, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe, plan


def output(result) -> torch.Tensor:
    for field in ("images", "frames"):
        value = getattr(result, field, None)
        if value is not None:
            if isinstance(value, list) and value and not isinstance(value[0], (np.ndarray, torch.Tensor)):
                value = [np.asarray(v) for v in value]
            if isinstance(value, torch.Tensor):
                return value.detach().cpu().float()
            return torch.as_tensor(np.asarray(value)).float()
    return torch.as_tensor(result[0]).float()


def run(pipe, kind: str, **over) -> torch.Tensor:
    return output(pipe(**call_of(kind, pipe, **over)))


def diff(a, b) -> float:
    a, b = torch.as_tensor(a).detach().cpu().float(), torch.as_tensor(b).detach().cpu().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


class fake_cuda(contextlib.AbstractContextManager):
    """pipemap's fake CUDA with two GPUs for the block (tests/fakecuda.py)."""

    def __init__(self, gpus: int = 2, memory: int | None = None):
        self.gpus, self.memory = gpus, memory

    def __enter__(self):
        import fakecuda
        from pipemap.runtime import transfer

        transfer.clear_transfer_cache()
        self.fake = fakecuda.install(gpus=self.gpus)
        if self.memory is not None:
            self.fake.memory = self.memory
        # The fake's own defect (tests/fakecuda.py, HostMode): any torch function given a `device=` keyword is run as a
        # factory on the CPU, torch._C._nn._parse_to included, so `module.to(device=torch.device("cuda:1"))` puts the
        # module on the CPU (positional `module.to("cuda:1")` works). diffusers calls it so, e.g. load_lora_weights'
        # `text_encoder.to(device=text_encoder.device, dtype=...)`. Pass the device positionally, as CUDA reads it.
        self._to = torch.nn.Module.to
        torch.nn.Module.to = _device_positional(self._to)
        return self.fake

    def __exit__(self, *exc):
        import gc

        gc.collect()
        torch.nn.Module.to = self._to
        self.fake.exit()
        return False


def _device_positional(to):
    def module_to(self, *args, **kwargs):
        if "device" in kwargs:
            args = (kwargs.pop("device"), *args)
        return to(self, *args, **kwargs)

    return module_to


ROWS: list[tuple] = []


def row(scenario: str, mode: str, plain_result: str, pipemap_result: str, detail: str, ok: bool) -> bool:
    ROWS.append((scenario, mode, plain_result, pipemap_result, detail, ok))
    print(f"RESULT | {scenario} | {mode} | {plain_result} | {pipemap_result} | {detail} | "
          f"{'works' if ok else 'FAIL'}", flush=True)
    return ok


def compare(scenario: str, mode: str, want, got, tol: float = TOL, plain_result: str = "runs") -> bool:
    d = diff(want, got)
    return row(scenario, mode, plain_result, "runs", f"{d:.3g}", d <= tol)


def attempt(scenario: str, mode: str, want, make, tol: float = TOL, plain_result: str = "runs") -> bool:
    """``make()`` -> output compared with ``want``; an exception is a failed row with its type and message."""
    try:
        got = make()
    except Exception as err:  # noqa: BLE001
        msg = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        if os.environ.get("US4_TRACE"):
            traceback.print_exc()
        return row(scenario, mode, plain_result, "error", msg, False)
    return compare(scenario, mode, want, got, tol, plain_result)


def finish() -> None:
    bad = [r for r in ROWS if not r[5]]
    print(f"{len(ROWS) - len(bad)}/{len(ROWS)} rows as diffusers")
    print("FAIL" if bad else "PASS")


def save_lora(kind: str, seed: int = 1, targets=("to_q", "to_k", "to_v", "to_out.0"), text_encoder: bool = False,
              rank: int = 4) -> str:
    """A random LoRA for the tiny ``kind`` pipeline's denoiser (and its first text encoder), saved as diffusers'
    training scripts save one (needs peft). Returns the folder."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    path = os.path.join(WORK, f"lora-{kind}-{seed}{'-te' if text_encoder else ''}")
    if os.path.exists(os.path.join(path, "pytorch_lora_weights.safetensors")):
        return path
    pipe = plain(kind)
    den = pipe.transformer if hasattr(pipe, "transformer") and pipe.transformer is not None else pipe.unet
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        den.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=list(targets)))
        layers = {("transformer_lora_layers" if den is getattr(pipe, "transformer", None) else "unet_lora_layers"):
                  convert_state_dict_to_diffusers(get_peft_model_state_dict(den))}
        if text_encoder:
            from peft import inject_adapter_in_model  # transformers' add_adapter wants a newer peft

            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                               target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]),
                                    pipe.text_encoder)
            layers["text_encoder_lora_layers"] = convert_state_dict_to_diffusers(
                get_peft_model_state_dict(pipe.text_encoder))
    type(pipe).save_lora_weights(path, **layers, safe_serialization=True)
    return path


def fake_ok(kind: str, strategy: str) -> bool:
    """The fake CUDA cannot run torch's functional collectives, which the sequence mode (Flux, Qwen-Image under
    "parallel") exchanges through; those cases run on the CPU remap only."""
    return not (kind in ("flux", "qwen_image") and strategy == "parallel")


def cases(kinds, strategies=STRATEGIES, modes=("cpu", "fake")):
    """(kind, strategy, mode, context) for every combination the machine can run."""
    for mode in modes:
        for kind in kinds:
            for strategy in strategies:
                if mode == "fake" and not fake_ok(kind, strategy):
                    continue
                yield kind, strategy, mode, (fake_cuda() if mode == "fake" else contextlib.nullcontext())


# the same placements with 8 MiB of activation room on each GPU (run_many's admission checks calls against it)
ROOMY = {
    "sd": {"balanced": "2x13MiB,cpu=1GiB", "balanced_low_memory": "cuda:0=12MiB,cuda:1=9MiB,cpu=1GiB",
           "balanced_ultra_low_memory": "2x10MiB,cpu=1GiB", "parallel": "2x16MiB,cpu=1GiB"},
    "wan_t2v": {"balanced": "2x9MiB,cpu=1GiB", "parallel": "2x16MiB,cpu=1GiB"},
}


def placed_roomy(kind: str, strategy: str, mode: str = "cpu"):
    plan = pipemap.plan(folder(kind), hardware=ROOMY[kind][strategy], strategy=strategy, headroom="8MiB")
    pipe = pipemap.load(folder(kind), plan=plan.remap(ON_CPU) if mode == "cpu" else plan, progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe, plan
SPLIT = {"sd": "2x3400KiB,cpu=1GiB"}  # unet cut between cuda:0 and cuda:1 (up_blocks.1)
