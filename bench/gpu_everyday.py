"""Everyday diffusers under a plan, on a real GPU when one is lent (issue 27's device checks), else on the CPU with the
plan remapped there: the tiny SD pipeline placed with its unet offloaded, then

1. a LoRA loaded after placing: the first call runs (no device mismatch), output as on plain diffusers;
2. ``fuse_lora`` then an eviction: the fused weights survive;
3. ``unet.compile()`` (a counting backend): graphs after each of 5 calls, none new after the first;
4. the unet quantized (optimum-quanto int8): the bytes an onload puts on the GPU (``torch.cuda.max_memory_allocated``
   around the first call's onload, or the ledger's peak on the CPU) against its stored size.

    PYTHONPATH=src:tests python bench/gpu_everyday.py          # about a minute; prints one line per check
"""

from __future__ import annotations

import tempfile

import torch

import pipemap
from everyday import images, plain, quantize, save_lora, two_gpu_plan
from pipemap.dispatch import onload_peaks
from pipemap.quantized import stored_bytes

CUDA = torch.cuda.is_available()


def placed(pipe, strategy: str = "balanced_low_memory"):
    plan = two_gpu_plan(pipe, strategy)
    gpus = torch.cuda.device_count() if CUDA else 0
    mapping = {"cuda:1": "cuda:0"} if gpus == 1 else {} if gpus > 1 else {"cuda:0": "cpu", "cuda:1": "cpu"}
    pipemap.dispatch(pipe, plan.remap(mapping) if mapping else plan)
    return pipe


def lora_checks(folder: str) -> None:
    reference, pipe = plain("sd"), placed(plain("sd"))
    for p in (reference, pipe):
        p.load_lora_weights(folder, adapter_name="a")
    got, want = images(pipe, "sd"), images(reference, "sd")
    print(f"lora after placing: max difference {(got.cpu() - want).abs().max().item():.2e}")
    for p in (reference, pipe):
        p.fuse_lora()
        p.unload_lora_weights()
    pipe.text_encoder(torch.zeros(1, 8, dtype=torch.long))  # the text encoder onloaded: may evict the unet
    got, want = images(pipe, "sd"), images(reference, "sd")
    print(f"fused lora after eviction: max difference {(got.cpu() - want).abs().max().item():.2e}")
    pipemap.reset(pipe)
    got = images(pipe, "sd")
    print(f"fused lora after reset: max difference {(got - want).abs().max().item():.2e}")


def compile_check() -> None:
    graphs = []

    def backend(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    pipe = placed(plain("sd"))
    pipe.unet.compile(backend=backend)
    counts = []
    for _ in range(5):
        images(pipe, "sd")
        counts.append(len(graphs))
    print(f"compiled unet under offload: graphs after each of 5 calls {counts}")
    pipemap.reset(pipe)


def quantized_check() -> None:
    pipe = plain("sd")
    quantize(pipe.unet, "quanto")
    stored = sum(stored_bytes(t) for t in {id(t): t for t in pipe.unet.parameters()}.values())
    pipe = placed(pipe)
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        pipe.unet._hf_hook.cache.use(pipe.unet._hf_hook)  # the onload alone
        torch.cuda.synchronize()
        onloaded = torch.cuda.max_memory_allocated() - before
    else:
        images(pipe, "sd")
        onloaded = pipe.unet._hf_hook.group.layout.nbytes
    print(f"quanto int8 unet: stored {stored} B, onloaded {onloaded} B ({onloaded / stored:.2f}x); peaks "
          f"{onload_peaks(pipe)}")
    pipemap.reset(pipe)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name(0) if CUDA else 'cpu (plan remapped)'}")
    lora_checks(save_lora("sd", tempfile.mkdtemp(), seed=1))
    compile_check()
    quantized_check()


if __name__ == "__main__":
    main()
