"""(a) Models as users bring them, on worker processes (PIPEMAP_WORKERS=process, tiny Flux with true CFG, mode
"guidance", a plan for 2 GPUs remapped onto the CPU), against the same model plain and against the thread path:

  1. ``enable_layerwise_casting`` (diffusers' fp8-storage recipe: weights stored float8_e4m3fn, computed in float32)
  2. an attention processor class defined in the user's script (``__main__``), set with ``set_attn_processor``
  3. a diffusers cache (FirstBlockCache, ``enable_cache``) on the transformer
  4. the calls made under diffusers' ``attention_backend("_native_math")`` (a process-wide setting, as
     ``torch.backends.cuda.matmul.allow_tf32`` is): does the worker compute as rank 0 does?

Run from the project root (one command):
  OMP_NUM_THREADS=1 PYTHONPATH=src:tests nice -n 10 python bench/repros/workers/user_models_and_numerics.py [case]
Prints one line per case and path: what dispatch and the call did.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PIPEMAP_WORKER_TIMEOUT", "60")

import torch  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor  # noqa: E402

import pipemap  # noqa: E402
from helpers import processes_gone, with_copy  # noqa: E402
from pipemap import tiny  # noqa: E402


class MyProcessor(FluxAttnProcessor):
    """A user's processor (here it computes as Flux's own does), defined in the user's script."""


def build():
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), num_inference_steps=3, negative_prompt="blurry",
                true_cfg_scale=2.0)
    return pipe, call


CONTEXT = {"on": False}


def run(pipe, call):
    import contextlib

    from diffusers.models.attention_dispatch import attention_backend

    with attention_backend("_native_math") if CONTEXT["on"] else contextlib.nullcontext():
        return torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)


def prepare(pipe, case: str) -> None:
    if case == "layerwise":
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    elif case == "main-processor":
        pipe.transformer.set_attn_processor(MyProcessor())
    elif case == "cache":
        from diffusers import FirstBlockCacheConfig

        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))


def one(case: str, workers: str) -> None:
    os.environ["PIPEMAP_WORKERS"] = workers
    CONTEXT["on"] = case == "attention-backend"
    pipe, call = build()
    prepare(pipe, case)
    plain = run(pipe, call)
    t0 = time.monotonic()
    try:
        pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    except Exception as err:  # noqa: BLE001
        text = " | ".join(line for line in str(err).splitlines() if line.strip())[-400:]
        print(f"{case} [{workers}]: dispatch raised {type(err).__name__} after {time.monotonic() - t0:.1f}s: {text}",
              flush=True)
        return
    hook = pipe.transformer._hf_hook
    pids = hook.pids() if hasattr(hook, "pids") else []
    try:
        got = run(pipe, call)
        diff = (got - plain).abs().max().item()
        print(f"{case} [{workers}]: {type(hook).__name__} ran, max|placed - plain| {diff:.2e}, hits {hook.hits} "
              f"misses {hook.misses}", flush=True)
    except Exception as err:  # noqa: BLE001
        print(f"{case} [{workers}]: call raised {type(err).__name__}: {str(err).splitlines()[0][:300]}", flush=True)
    pipemap.reset(pipe)
    processes_gone(pids)


if __name__ == "__main__":
    for case in sys.argv[1:] or ("layerwise", "main-processor", "cache", "attention-backend"):
        for workers in ("thread", "process"):
            one(case, workers)
