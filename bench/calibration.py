"""The cost model against published measurements, in two tables. Writes bench/CALIBRATION.md and prints it.

    python bench/calibration.py

Fit rows: each constant of the model is fitted on the one published figure named beside it (this script solves for
it and checks that the code's constant is that value, rounded). Check rows: published figures priced with the
fitted constants and nothing fitted on them: other GPUs, other architectures, other mechanisms. Each setup's work
is counted by a dry run at the source's own shapes (``pipemap.dryrun``: the catalog's recorded counts for a
pipeline's default call, else a dry run, kept on disk by call shape); the GPU figures are datasheet figures
(``hardware.GPU_PERFORMANCE``) times the fitted share. The published figures are data here, each with its source;
a check row outside 0.8x-1.25x is reported, not tuned away.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch._subclasses.fake_tensor import FakeTensorMode

import pipemap
from pipemap import catalog, cost, hardware
from pipemap.cost import Mechanism, Piece, call_seconds, compute_seconds, copy_seconds, launch_seconds
from pipemap.counts import ComponentCounts, Counts
from pipemap.dryrun import standin
from pipemap.dryrun.counted import counting_plan, counts_for
from pipemap.dryrun.counter import WorkCounter
from pipemap.dryrun.run import count_work
from pipemap.granularity import Block
from pipemap.hardware import GPU_PERFORMANCE, Performance
from pipemap.inventory import Component, live_component

FLUX, SDXL, SD15, SD35, QWEN = ("flux.1-dev", "stable-diffusion-xl-base-1.0", "stable-diffusion-1.5",
                                "stable-diffusion-3.5-large", "qwen-image")
CACHE_DIT = ("https://github.com/vipshop/cache-dit/blob/810b1f93/docs/user_guide/OFFLOAD.md (L20, FLUX.1-dev, 28 "
             "steps, 1024x1024)")
CACHE_DIT_H100 = ("https://github.com/vipshop/cache-dit/blob/main/docs/benchmark/NVIDIA_GPU.md (H100, baseline, "
                  "`cache_dit.generate`: 1024x1024; Qwen-Image with negative_prompt=' ', true_cfg_scale=4.0)")
DIFFUSERS = ("https://huggingface.co/datasets/diffusers/benchmarks (collated_results.csv; runner aws-g6e = L40S; "
             "benchmarks/benchmarking_{flux,sdxl,ltx}.py: one denoiser forward, bf16, batch 1)")
XDIT = ("https://github.com/xdit-project/xDiT/blob/main/docs/performance/flux.md (H100, FLUX.1-dev, 28 steps, "
        "1024px, 1 GPU, no torch.compile)")
XDIT_PAIR = ("https://github.com/xdit-project/xDiT/blob/main/docs/performance/flux.md (H100, FLUX.1-dev, 28 steps, "
             "1024px, 2 GPUs, Ulysses-2, no torch.compile)")
XDIT_FOUR = ("https://github.com/xdit-project/xDiT/blob/main/docs/performance/flux.md (4xH100, FLUX.1-dev, 28 steps, "
             "1024px, Ulysses-4, no torch.compile; read after every constant was fitted)")
VLLM_OMNI = ("https://docs.vllm.ai/projects/vllm-omni/en/latest/user_guide/acceleration/parallelism_acceleration "
             "(Qwen/Qwen-Image, 2048x2048, 50 steps, H800, sdpa; baseline diffusers 112.5 s, Ulysses-SP 2 / 4 / 8: "
             "65.2 / 39.6 / 30.8 s; two transformer calls a step, as the 1-GPU time says)")
CACHE_DIT_L20_PAIR = ("https://github.com/vipshop/cache-dit/blob/0a0dc862/docs/benchmark/NVIDIA_GPU.md (L20x2, "
                      "FLUX.1-dev w/o CPU offload, 28 steps, 1024x1024, CP2 Ulysses, no compile: 13.87 s)")
CACHE_DIT_H100_PAIR = ("https://github.com/vipshop/cache-dit/blob/main/docs/benchmark/NVIDIA_GPU.md (at 49aa56bb: "
                       "H100, Ulysses 2, `torchrun --nproc_per_node=2 -m cache_dit.generate {flux,qwen_image} "
                       "--steps 50 --parallel ulysses`: FLUX.1-dev 6.04 s, Qwen-Image 12.81 s; 1 GPU 9.30 / 18.49 s)")
WAN_README = ("https://github.com/Wan-Video/Wan2.1 (README, 'Computational Efficiency on Different GPUs', "
              "assets/comp_effic.png, total time: T2V-14B at 720P on H800/H100, A800/A100, H20 and T2V-1.3B at 480P "
              "on 4090, 1/2/4/8 GPUs; the official repo: 81 frames, 50 steps, two transformer calls a step, "
              "flash-attn 2, Ulysses over the GPUs with FSDP weights; one GPU with --offload_model True, the 4090's "
              "with --t5_cpu too)")
WAN22_README = ("https://github.com/Wan-Video/Wan2.2 (README, 'Computational Efficiency on Different GPUs', "
                "assets/comp_effic.png, total time after warm-up: T2V-A14B at 480P and 720P on H100/H800, A100/A800, "
                "H20 and TI2V-5B T2V at 720P (1280x704x121) on 4090, 1/4/8 GPUs; the official repo: 81 frames, 40 "
                "steps (the 5B: 50), two calls a step, FlashAttention-3 on Hopper; Ulysses with FSDP weights over "
                "several GPUs; one GPU with --offload_model True --convert_model_dtype, the 5B with --t5_cpu too)")
XDIT_HUNYUAN = ("https://github.com/xdit-project/xDiT/blob/main/docs/performance/hunyuanvideo.md (129 frames, 50 "
                "steps, Ulysses: 1280x720 over 1/2/4/8 GPUs, 960x960 over 1/2/3/6; H100 and H20: the official "
                "HunyuanVideo repo, L20: diffusers with flash-attn 2.7.2)")
XDIT_SANA = ("https://github.com/xdit-project/xDiT/blob/main/docs/performance/sana.md (Sana_1600M_4Kpx_BF16_diffusers, "
             "4096x4096, 20 steps, 8xA100 NVLink: 1 GPU 17.551 s, Ulysses-2 10.175 s, CFG-2 8.365 s)")
PARA_ATTN = ("https://github.com/huggingface/diffusers/blob/main/docs/source/en/optimization/para_attn.md "
             "(ParaAttention's baseline on an NVIDIA L20, no optimization: FLUX.1-dev 1024x1024, 28 steps, 26.36 s; "
             "HunyuanVideo 1280x720x129, 30 steps, VAE tiling, 3675.71 s)")
ORT = ("https://github.com/microsoft/onnxruntime/pull/22986 (H100 80GB HBM3, 1024x1024, batch 1, BF16, "
       "Torch 2.5.1 eager)")
FAL = ("https://github.com/fal-ai/stable-diffusion-benchmarks (A100 80G SXM, diffusers 0.21.4, torch 2.1, SDPA, "
       "fp16, 50 steps, default guidance)")
# LTX-Video 0.9.7-dev's transformer (13.0B), as published: https://huggingface.co/Lightricks/LTX-Video-0.9.7-dev
LTX_CONFIG = {"activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 128,
              "attention_out_bias": True, "caption_channels": 4096, "cross_attention_dim": 4096, "in_channels": 128,
              "norm_elementwise_affine": False, "norm_eps": 1e-06, "num_attention_heads": 32, "num_layers": 48,
              "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm_across_heads"}

# the mechanisms other tools move weights by
DIFFUSERS_SEQUENTIAL = Mechanism(pinned=False, overlap=False)  # accelerate's AlignDevicesHook: .to() per leaf
DIFFUSERS_MODEL_OFFLOAD = Mechanism(pinned=False, overlap=False, copy_back=True)  # CpuOffload: in and back out
# diffusers' group offload (leaf_level, use_stream=True, record_stream off, as its benchmark runs it), as
# hooks/group_offloading.py runs it: pinned, leaf by leaf, the next leaf's copy started on a side stream as a leaf
# begins, the host waiting for that leaf's copy before it (``stream.synchronize()``) and for its compute after it
# (``current_stream().synchronize()`` in ``offload_``): a copy hides behind one leaf's compute only, and the link and
# the GPU idle while the hook's Python runs between leaves. That time a leaf is measured, not fitted: diffusers'
# leaf-level hooks on 400 Linear(8, 8) leaves on the CPU, less the same model without them, on the 2-core VM of
# bench/RESULTS.md (126 us; the stream path adds two synchronizes, a faster host takes less). The host link of
# diffusers' benchmark runner (an aws-g6e L40S) is fitted on its FLUX.1-dev group-offload row. cache-dit's layerwise
# offload never waits on the host: its copies queue ahead as pipemap's do.
GROUP_WAIT_LATENCY = 126e-6
RUNNER_HOST_BANDWIDTH = 16.5e9
ROUNDING = 0.03  # a code constant is "the fitted value" within 3%
AFTER = " [re-modelled after the first run, see below]"


@dataclass(frozen=True)
class Row:
    gpu: str
    setup: str
    published: float
    predicted: float
    source: str
    fits: str = ""  # the constant this row fits, for a fit row
    model: str = ""  # the model it runs, to tell a check row that repeats a fit row's GPU and model
    label: str = ""  # a check row: "independent" or "repeat" (the same GPU and model as a fit row)
    terms: str = ""  # a check row: the fitted constants that set its price (``sensitive_terms``)

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


# ---- the machine -------------------------------------------------------------------------------------------------


# The attention backend every source's stack ran: PyTorch's SDPA picks FlashAttention-2 for 16-bit inputs without a
# mask on Ampere, Ada and Hopper GPUs (torch 2.1-2.5 eager, diffusers' default attention processor)
ATTENTION = hardware.DEFAULT_ATTENTION


def perf(gpu: str, share: float | None = None, kernel: float | None = None, attention: str | None = None
         ) -> Performance:
    """A GPU's figures at a trial share and kernel overhead (the code's unless given), attention at the published
    rate of ``attention`` (``ATTENTION`` unless given: the backend the source's stack ran)."""
    attention = attention or ATTENTION
    flops, memory, host, peer = GPU_PERFORMANCE[gpu]
    memory_share = hardware.sustained_share(gpu)[0] if share is None else share
    share = hardware.tensor_share(gpu)[0] if share is None else share
    kernel = hardware.launch_default(gpu)[0] if kernel is None else kernel
    return Performance(flops * share, host, peer, memory_bandwidth=memory * memory_share, kernel_seconds=kernel,
                       attention=attention, attention_flops=hardware.attention_rate(gpu, attention)[0])


# ---- the work ----------------------------------------------------------------------------------------------------


def counts(name: str, dtype: str | None = None, **call) -> Counts:
    """A catalog pipeline's counts for a call: recorded for the default call, else counted by a dry run (kept)."""
    found = counts_for(name, dtype or catalog.entry(name).dtype, call)
    assert found is not None
    return found


@functools.cache
def fine_counts(name: str) -> Counts:
    """A catalog pipeline's default call counted by a dry run now, with its work by leaf module (the catalog's record
    keeps three levels of modules): what leaf-by-leaf offloads are priced from."""
    return count_work(name, counting_plan(name, catalog.entry(name).dtype))


@functools.cache
def ltx_forward() -> tuple[ComponentCounts, Component]:
    """One forward of LTX-Video 0.9.7-dev's transformer at diffusers' benchmark inputs (512x704, 161 frames: 7392
    tokens; 256 text tokens), counted on stand-in tensors, and its module tree."""
    from diffusers import LTXVideoTransformer3DModel

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with init_empty_weights(include_buffers=False):
        module = LTXVideoTransformer3DModel.from_config(LTX_CONFIG)
    component = live_component("transformer", module, torch.bfloat16)
    standin.fill_fakes(module, mode, "meta:0", torch.bfloat16, ()).eval()
    counter = WorkCounter(types.SimpleNamespace(components={"transformer": module}))
    with torch.no_grad(), standin.fused_attention(), mode, counter:
        kw = {"device": "meta:0", "dtype": torch.bfloat16}
        module(hidden_states=torch.randn(1, 7392, 128, **kw), encoder_hidden_states=torch.randn(1, 256, 4096, **kw),
               encoder_attention_mask=torch.ones(1, 256, **kw), timestep=torch.tensor([1.0], **kw),
               video_coords=torch.randn(1, 3, 7392, **kw))
    return counter.counts("LTXVideoTransformer3DModel", (), 1, 1, "bfloat16")["transformer"], component


def forward(name: str, denoiser: str, **call) -> tuple[ComponentCounts, Component]:
    """One call of a catalog pipeline's denoiser (batch 1: guidance off, as diffusers' benchmark calls it), with its
    work by leaf module."""
    found = counts(name, "bfloat16", **call) if call else fine_counts(name)
    return found[denoiser], pipemap.inspect(name, dtype=torch.bfloat16)[denoiser]


# ---- the setups --------------------------------------------------------------------------------------------------


def one_call(work: ComponentCounts, p: Performance) -> float:
    return compute_seconds(work.per_call(1), p)


def resident(found: Counts, p: Performance, steps: int | None = None) -> float:
    """A whole call with every component resident on the GPU."""
    return sum(compute_seconds(c.total(found.iterations(steps)), p) for c in found.components)


def leaves(component: Component) -> tuple[list[tuple[str, int]], int]:
    """A component's leaf modules with weights, in module order, and the bytes of the rest (the tensors of modules
    that have children too: moved with the root)."""
    out, stack, rest = [], [component.tree], 0
    while stack:
        block: Block = stack.pop(0)
        if block.children:
            rest += block.own
            stack[:0] = list(block.children)
        elif block.own:
            out.append((block.path, block.own))
    return out, rest


def leaf_streamed(work: ComponentCounts, component: Component, p: Performance, calls: float, mechanism: Mechanism,
                  depth: int = 1, persistent: frozenset = frozenset()) -> float:
    """A component offloaded leaf by leaf (diffusers' group offload at leaf level, cache-dit's layerwise offload,
    accelerate's sequential offload): each leaf copied at every call (unless persistent), ``depth`` leaves ahead on a
    side stream without buffer limit (each copy its own allocation), each copy ``mechanism.copy_latency`` more."""
    pieces_at, rest = leaves(component)
    per_call = work.per_call(1) if not work.calls_once else work.total(1).scaled(1 / max(1.0, work.calls_once))
    table = {path: work.inside(path) for path, _ in pieces_at}
    bandwidth = p.host_bandwidth * (1.0 if mechanism.pinned else cost.PAGEABLE_SHARE)
    pieces = [Piece(compute_seconds(table[path], p),
                    None if path in persistent else copy_seconds(size, bandwidth, 1, mechanism.copy_latency),
                    launch_seconds(table[path], p))
              for path, size in pieces_at]
    inside = sum((table[path] for path, _ in pieces_at), start=type(per_call)())
    loose = compute_seconds(type(per_call)(*(max(0.0, a - b) for a, b in zip(per_call.to_list(exact=True),
                                                                             inside.to_list(exact=True)))), p)
    root = copy_seconds(rest, bandwidth, 1, mechanism.copy_latency) if rest else 0.0
    return calls * call_seconds([Piece(loose), *pieces], root, depth, True, mechanism)


def persistent_bins(component: Component, buckets: int, bins: int) -> frozenset:
    """cache-dit's persistent targets: ``buckets`` leaves in ``bins`` evenly spaced ranges of the leaf list."""
    paths = [path for path, _ in leaves(component)[0]]
    each, stride = buckets // bins, len(paths) // bins
    return frozenset(paths[b * stride + i] for b in range(bins) for i in range(each))


def pipeline_streamed(name: str, p: Performance, mechanism: Mechanism, depth: dict[str, int],
                      persistent: dict[str, tuple[int, int]], steps: int | None = None) -> float:
    """Every component of a catalog pipeline offloaded leaf by leaf, as cache-dit's layerwise offload runs it."""
    found = fine_counts(name)
    inventory = pipemap.inspect(name)
    total = 0.0
    for work in found.components:
        if work.component not in {c.name for c in inventory.models}:
            total += compute_seconds(work.total(found.iterations(steps)), p)
            continue
        component = inventory[work.component]
        kept = persistent_bins(component, *persistent[work.component]) if work.component in persistent else frozenset()
        calls = work.calls(found.iterations(steps))
        total += leaf_streamed(work, component, p, calls, mechanism, depth.get(work.component, 1), kept)
    return total


def planned(name: str, gpu: str, gib: float, strategy: str, p: Performance, mechanism: Mechanism = cost.PIPEMAP,
            found: Counts | None = None) -> float:
    """A catalog pipeline planned by pipemap's planner on one GPU of ``gib`` GiB (no headroom), priced."""
    inventory = pipemap.inspect(name)
    machine = pipemap.Hardware.parse(f"cuda:0={int(gib * 2**30)},cpu=256GiB,gpu={gpu}")
    plan = pipemap.plan(inventory, hardware=machine, strategy=strategy, headroom=0.0)
    return cost.seconds_per_image(plan, inventory, p, mechanism=mechanism, counts=found or counts(name))


def two_gpus(name: str, gpu: str, kernel: float | None = None, gpus: int = 2) -> tuple[float, str]:
    """A catalog pipeline's "parallel" plan on ``gpus`` 80 GiB GPUs of a model (its default call), priced (at a
    trial launch cost when given), and how it shares the denoiser."""
    inventory, plan = split_plan(name, gpu, gpus)
    shared = next((str(p.mode) for p in plan.components if p.replicas), "none")
    return cost.seconds_per_image(plan, inventory, perf(gpu, kernel=kernel), counts=counts(name)), shared


@functools.cache
def split_plan(name: str, gpu: str, gpus: int) -> tuple[pipemap.Inventory, pipemap.Plan]:
    inventory = pipemap.inspect(name)
    return inventory, pipemap.plan(inventory, hardware=pipemap.Hardware.parse(f"{gpus}x80GiB,cpu=256GiB,gpu={gpu}"),
                                   strategy="parallel")


QWEN_2048 = {"negative_prompt": " ", "true_cfg_scale": 4.0, "height": 2048, "width": 2048}


def ulysses(name: str, gpu: str, gpus: int, kernel: float | None = None, **call) -> float:
    """A catalog pipeline's call with its denoiser's tokens split over ``gpus`` GPUs of a model (the "parallel" plan
    of its default call: a sequence split on every GPU; one GPU resident), priced from the call's counts."""
    inventory, plan = split_plan(name, gpu, gpus) if gpus > 1 else (pipemap.inspect(name), pipemap.plan(
        name, hardware=pipemap.Hardware.parse(f"1x80GiB,cpu=256GiB,gpu={gpu}")))
    return cost.seconds_per_image(plan, inventory, perf(gpu, kernel=kernel), cost.workload_for(inventory, call),
                                  counts=counts(name, **call))


def as_run(name: str, gpu: str, gpus: int, cpu: tuple[str, ...] = (), mode: str = "sequence",
           attention: str | None = None, **call) -> float:
    """A catalog pipeline's call as a source's own stack ran it: its transformer's (and a second expert's) tokens split
    over ``gpus`` GPUs of a model (Ulysses: pipemap's sequence mode, whether or not pipemap's planner would split that
    transformer; or ``mode="replicated"``: a batch of two guidance halves cut across two, xDiT's CFG parallel), every
    other component resident on the first GPU, or computed on the CPU where ``cpu`` names it; attention at the rate
    of the source's backend (``attention``: ``ATTENTION`` unless given); priced from the call's counts, each rank a
    process."""
    inventory = pipemap.inspect(name)
    plan = pipemap.plan(inventory, hardware=f"{gpus}x1000GiB,cpu=256GiB,gpu={gpu}", headroom=0.0, ranks="process")
    replicas = tuple(f"cuda:{i}" for i in range(1, gpus))
    placements = tuple(
        replace(p, device="cpu", execution_device="cpu") if p.component in cpu
        else replace(p, device="cuda:0", execution_device="cuda:0", mode=pipemap.Mode(mode), replicas=replicas)
        if p.component in cost.PER_STEP and gpus > 1
        else replace(p, device="cuda:0", execution_device="cuda:0") for p in plan.components)
    return cost.seconds_per_image(replace(plan, components=placements), inventory, perf(gpu, attention=attention),
                                  cost.workload_for(inventory, call), counts=counts(name, **call))


WAN_14B, WAN_13B, HUNYUAN = "wan2.1-t2v-14b", "wan2.1-t2v-1.3b", "hunyuanvideo"
WAN_720 = {"height": 720, "width": 1280, "num_frames": 81, "num_inference_steps": 50}
WAN_480 = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50}
HUNYUAN_720 = {"height": 720, "width": 1280, "num_frames": 129, "num_inference_steps": 50}
# the Wan 2.1 README's table (total seconds on 1 / 2 / 4 / 8 GPUs) and xDiT's HunyuanVideo table (1 / 2 / 4 / 8)
WAN_TABLE = (("H100", "h100", WAN_14B, (1837.9, 945.1, 497.0, 287.9)),
             ("A100", "a100", WAN_14B, (3342.6, 1722.0, 886.1, 469.9)),
             ("H20", "h20", WAN_14B, (6935.5, 3488.4, 1775.8, 980.5)),
             ("4090", "4090", WAN_13B, (261.4, 188.5, 120.8)))  # 8 4090s ran ring attention: dropped
HUNYUAN_TABLE = (("H100", "h100", (1904.08, 925.04, 514.08, 337.58)), ("H20", "h20", (6639.17, 3400.55, 1762.86,
                                                                                      940.97)),
                 ("L20", "l20", (6043.88, 3271.44, 2080.05)))
# xDiT's second HunyuanVideo table: 960x960, on 1 / 2 / 3 / 6 GPUs
HUNYUAN_960 = {"height": 960, "width": 960, "num_frames": 129, "num_inference_steps": 50}
HUNYUAN_960_TABLE = (("H100", "h100", (1735.01, 934.09, 645.45, 367.02)),
                     ("H20", "h20", (6621.46, 3400.55, 2310.48, 1214.67)), ("L20", "l20", (6039.08, 3260.62, 2284.74)))
# the Wan 2.2 README's table (total seconds on 1 / 4 / 8 GPUs), each GPU with the attention its stack ran
WAN22_A14B, WAN22_5B = "wan2.2-t2v-a14b", "wan2.2-ti2v-5b"
WAN22_TABLE = (("H100", "h100", "fa3", {"480P": (326.9, 91.7, 51.5), "720P": (1041.5, 288.7, 155.1)}),
               ("A100", "a100", "flash", {"480P": (785.7, 215.2, 119.9), "720P": (2735.7, 725.3, 386.7)}),
               ("H20", "h20", "fa3", {"480P": (1133.9, 306.6, 170.5), "720P": (4048.7, 1067.8, 564.7)}))
WAN22_SIZES = {"480P": (480, 832), "720P": (720, 1280)}
WAN22_5B_720 = {"height": 704, "width": 1280, "num_frames": 121, "num_inference_steps": 50}
SANA, SANA_4K = "sana-1600m-1024px", {"height": 4096, "width": 4096, "num_inference_steps": 20,
                                      "use_resolution_binning": False}
THIRD = " [added in issue 50's third stop]"


def video_rows() -> list[Row]:
    """The Wan 2.1 README's and xDiT's HunyuanVideo tables, every row pipemap prices as it ran."""
    rows = []
    for label, gpu, name, published in WAN_TABLE:
        model = "Wan 2.1 T2V-14B" if name == WAN_14B else "Wan 2.1 T2V-1.3B"
        call, size = (WAN_720, "1280x720x81") if name == WAN_14B else (WAN_480, "832x480x81")
        for gpus, seconds in zip((1, 2, 4, 8), published):
            cpu = ("text_encoder",) if gpu == "4090" and gpus == 1 else ()
            how = (f"on {gpus} GPUs, tokens split (Wan's Ulysses-{gpus}; pipemap: sequence)" if gpus > 1 else
                   "resident" + (", text encoder on the CPU (--t5_cpu)" if cpu else "")
                   + " (--offload_model's copies not priced)")
            rows.append(Row(label, f"{model} pipeline {how}, {size}, 50 steps, two calls a step" + THIRD, seconds,
                            as_run(name, gpu, gpus, cpu, **call), WAN_README))
    for table, call, counts_of, size in ((HUNYUAN_TABLE, HUNYUAN_720, (1, 2, 4, 8), "1280x720x129"),
                                         (HUNYUAN_960_TABLE, HUNYUAN_960, (1, 2, 3, 6), "960x960x129")):
        for label, gpu, published in table:
            for gpus, seconds in zip(counts_of, published):
                how = (f"on {gpus} GPUs, tokens split (xDiT Ulysses-{gpus}; pipemap: sequence)" if gpus > 1
                       else "resident")
                rows.append(Row(label, f"HunyuanVideo pipeline {how}, {size}, 50 steps, one call a step" + THIRD,
                                seconds, as_run(HUNYUAN, gpu, gpus, **call), XDIT_HUNYUAN))
    return rows


def wan22_rows() -> list[Row]:
    """The Wan 2.2 README's table: every text-to-video row (its two experts each split as the other is)."""
    rows = []
    for label, gpu, attention, tables in WAN22_TABLE:
        for res, published in tables.items():
            height, width = WAN22_SIZES[res]
            call = {"height": height, "width": width, "num_frames": 81, "num_inference_steps": 40}
            for gpus, seconds in zip((1, 4, 8), published):
                how = (f"on {gpus} GPUs, tokens split (Wan's Ulysses-{gpus}; pipemap: sequence, both experts)"
                       if gpus > 1 else "resident (--offload_model's copies not priced)")
                rows.append(Row(label, f"Wan 2.2 T2V-A14B pipeline {how}, {width}x{height}x81, 40 steps, two calls a "
                                f"step, {'FlashAttention-3' if attention == 'fa3' else 'FlashAttention-2'}" + THIRD,
                                seconds, as_run(WAN22_A14B, gpu, gpus, attention=attention, **call), WAN22_README))
    for gpus, seconds in zip((1, 4, 8), (534.7, 231.3, 157.2)):
        how = (f"on {gpus} GPUs, tokens split (Wan's Ulysses-{gpus}; pipemap: sequence)" if gpus > 1 else "resident")
        rows.append(Row("4090", f"Wan 2.2 TI2V-5B pipeline (text to video) {how}, text encoder on the CPU (--t5_cpu), "
                        "1280x704x121, 50 steps, two calls a step" + THIRD, seconds,
                        as_run(WAN22_5B, "4090", gpus, ("text_encoder",), **WAN22_5B_720), WAN22_README))
    return rows


def other_rows() -> list[Row]:
    """ParaAttention's L20 baselines and xDiT's SANA at 4096x4096 on A100s (1 GPU, Ulysses-2, CFG-2)."""
    sana = "SANA 1600M pipeline (the 1024px model's counts: the 4Kpx model's transformer differs in its sample size)"
    return [
        Row("L20", "FLUX.1-dev pipeline, 1024x1024, 28 steps, resident (ParaAttention's baseline)" + THIRD, 26.36,
            as_run(FLUX, "l20", 1), PARA_ATTN),
        Row("L20", "HunyuanVideo pipeline resident, 1280x720x129, 30 steps, one call a step (ParaAttention's "
            "baseline)" + THIRD, 3675.71, as_run(HUNYUAN, "l20", 1, **{**HUNYUAN_720, "num_inference_steps": 30}),
            PARA_ATTN),
        Row("A100", f"{sana}, 4096x4096, 20 steps, CFG as a batch of two, resident" + THIRD, 17.551,
            as_run(SANA, "a100", 1, **SANA_4K), XDIT_SANA),
        Row("A100", f"{sana} on 2 GPUs, 4096x4096, 20 steps, tokens split (xDiT Ulysses-2; pipemap: sequence)" + THIRD,
            10.175, as_run(SANA, "a100", 2, **SANA_4K), XDIT_SANA),
        Row("A100", f"{sana} on 2 GPUs, 4096x4096, 20 steps, the guidance batch cut across them (xDiT CFG-2; pipemap: "
            "replicated)" + THIRD, 8.365, as_run(SANA, "a100", 2, mode="replicated", **SANA_4K), XDIT_SANA),
    ]


def model_offload(name: str, p: Performance, mechanism: Mechanism) -> float:
    """diffusers' enable_model_cpu_offload: every model moved in at its call (and back out after)."""
    inventory = pipemap.inspect(name)
    plan = pipemap.plan(inventory, hardware="cuda:0=1000GiB,cpu=1000GiB", headroom=0.0)
    plan = replace(plan, components=tuple(pipemap.Placement(c.component, "cpu", c.bytes, "offload", "cuda:0")
                                          for c in plan.components))
    return cost.seconds_per_image(plan, inventory, p, mechanism=mechanism, counts=counts(name))


# ---- fitting -----------------------------------------------------------------------------------------------------


def bisect(predict: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The value in [low, high] at which the monotonic ``predict`` meets ``target``."""
    rising = predict(high) > predict(low)
    for _ in range(60):
        middle = (low + high) / 2
        if (predict(middle) < target) == rising:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def fit_a100_and_kernel() -> tuple[float, float]:
    """KERNEL_SECONDS and the A100's share from its two rows: SD 1.5 (a small UNet: the host launching kernels sets
    its time) and SDXL (the GPU's work sets most of it); each solved with the other held, until both settle."""
    sd, sdxl = counts(SD15), counts(SDXL)
    share, kernel = 0.7, 1e-5
    for _ in range(8):
        kernel = bisect(lambda x, s=share: resident(sd, perf("a100", s, x)), 1.591, 1e-7, 1e-3)
        share = bisect(lambda x, k=kernel: resident(sdxl, perf("a100", x, k)), 5.933, 0.05, 2.0)
    return share, kernel


def fit_hopper_launch() -> float:
    """The Hopper host's seconds a kernel launch (``hardware.HOST_LAUNCH``), fitted on xDiT's FLUX.1-dev over two
    H100s (each rank launches every kernel of its half), the H100's share held."""
    return bisect(lambda x: two_gpus(FLUX, "h100", x)[0], 4.38, 1e-6, 1e-4)


def fit_straggler_wait() -> float:
    """``cost.STRAGGLER_WAIT``, the seconds a rank waits for late peers a collective and rank beyond two, fitted on
    vLLM-Omni's Qwen-Image at 2048x2048 over 8 H800s (the Hopper host's launch and the H100's share held)."""
    saved = cost.STRAGGLER_WAIT

    def predict(wait: float) -> float:
        cost.STRAGGLER_WAIT = wait
        try:
            return ulysses(QWEN, "h800", 8, **QWEN_2048)
        finally:
            cost.STRAGGLER_WAIT = saved

    return bisect(predict, 30.8, 0.0, 1e-3)


def fit_share(gpu: str, seconds: Callable[[Performance], float], published: float) -> float:
    """A GPU's sustained share, the code's kernel overhead held."""
    return bisect(lambda x: seconds(perf(gpu, x)), published, 0.05, 2.0)


def group_offload() -> Mechanism:
    """diffusers' group offload at leaf level with streams: the host waits at each leaf, ``GROUP_WAIT_LATENCY`` a
    leaf in its hook."""
    return Mechanism(waits=True, wait_latency=GROUP_WAIT_LATENCY)


def runner(bandwidth: float = 0.0) -> Performance:
    """The L40S of diffusers' benchmark runner, with its host link (the fitted one unless given)."""
    return replace(perf("l40s"), host_bandwidth=bandwidth or RUNNER_HOST_BANDWIDTH)


def fit_runner_bandwidth() -> float:
    flux, component = forward(FLUX, "transformer")
    return bisect(lambda x: leaf_streamed(flux, component, runner(x), 1, group_offload()), 1.859, 1e9, 50e9)


def fit_pageable() -> float:
    p = perf("l20")

    def predict(share: float) -> float:
        saved = cost.PAGEABLE_SHARE
        cost.PAGEABLE_SHARE = share
        try:
            return sequential(p)
        finally:
            cost.PAGEABLE_SHARE = saved

    return bisect(predict, 335, 0.01, 1.0)


def sequential(p: Performance) -> float:
    return pipeline_streamed(FLUX, p, DIFFUSERS_SEQUENTIAL, {}, {})


# ---- the tables --------------------------------------------------------------------------------------------------


def fit_rows() -> list[Row]:
    a100, kernel = fit_a100_and_kernel()
    flux_call, component = forward(FLUX, "transformer")
    flux = counts(FLUX)
    fitted = {"a100": a100, "l40s": fit_share("l40s", lambda p: one_call(flux_call, p), 0.493),
              "h100": fit_share("h100", lambda p: resident(flux, p), 6.71)}
    bandwidth = fit_runner_bandwidth()
    pageable = fit_pageable()
    hopper = fit_hopper_launch()
    straggler = fit_straggler_wait()
    pair = two_gpus(FLUX, "h100")
    for name, found, used in (*((f"SUSTAINED[{g!r}]", v, hardware.SUSTAINED[g]) for g, v in fitted.items()),
                              ("KERNEL_SECONDS", kernel, hardware.KERNEL_SECONDS),
                              ("HOST_LAUNCH['hopper']", hopper, hardware.HOST_LAUNCH["hopper"]),
                              ("STRAGGLER_WAIT", straggler, cost.STRAGGLER_WAIT),
                              ("RUNNER_HOST_BANDWIDTH", bandwidth, RUNNER_HOST_BANDWIDTH),
                              ("PAGEABLE_SHARE", pageable, cost.PAGEABLE_SHARE)):
        if abs(used / found - 1) > ROUNDING:
            print(f"WARNING: {name} is {used:g} in the code, the fit says {found:.4g}: update the constant")
    share = "`hardware.SUSTAINED[{!r}]` = {:.3f}".format
    return [
        Row("A100", "SD 1.5 pipeline, 512x512, 50 steps, CFG, fp16, resident", 1.591,
            resident(counts(SD15), perf("a100")), FAL,
            f"`hardware.KERNEL_SECONDS` = {kernel * 1e6:.1f} us (with the next row)"),
        Row("A100", "SDXL pipeline, 1024x1024, 50 steps, CFG, fp16 (VAE upcast), resident", 5.933,
            resident(counts(SDXL), perf("a100")), FAL, share("a100", a100) + " (with the row above)"),
        Row("L40S", "FLUX.1-dev transformer, one forward 1024x1024, resident", 0.493,
            one_call(flux_call, perf("l40s")), DIFFUSERS + ", sha 152f7ca", share("l40s", fitted["l40s"])),
        Row("H100", "FLUX.1-dev pipeline, 1024x1024, 28 steps, resident", 6.71, resident(flux, perf("h100")), XDIT,
            share("h100", fitted["h100"])),
        Row("H100", f"FLUX.1-dev pipeline on 2 GPUs, tokens split (xDiT Ulysses-2; pipemap: {pair[1]}) [a check "
            "row until issue 50]", 4.38, pair[0], XDIT_PAIR,
            f"`hardware.HOST_LAUNCH['hopper']` = {hopper * 1e6:.1f} us (the Hopper and Blackwell hosts' default)"),
        Row("H800", "Qwen-Image pipeline on 8 GPUs, 2048x2048, 50 steps, true CFG, tokens split (vLLM-Omni "
            "Ulysses-8; pipemap: sequence) [added in issue 50's second stop]", 30.8,
            ulysses(QWEN, "h800", 8, **QWEN_2048), VLLM_OMNI,
            f"`cost.STRAGGLER_WAIT` = {straggler * 1e6:.0f} us a collective and rank beyond two (it replaced "
            "`cost.RANK_IMBALANCE`, fitted on the same row)"),
        Row("L40S", "FLUX.1-dev transformer, one forward, group offload leaf_level + stream (0.56 GB)", 1.859,
            leaf_streamed(flux_call, component, runner(), 1, group_offload()), DIFFUSERS,
            f"the runner's host link `RUNNER_HOST_BANDWIDTH` (bench only) = {bandwidth / 1e9:.1f} GB/s, diffusers' "
            f"hook {GROUP_WAIT_LATENCY * 1e6:.0f} us a leaf (measured)"),
        Row("L20", "FLUX.1-dev pipeline, diffusers sequential offload (~1 GiB)", 335, sequential(perf("l20")),
            CACHE_DIT, f"`cost.PAGEABLE_SHARE` = {pageable:.3f}"),
    ]


def check_rows() -> list[Row]:
    l40s, h100, l20 = perf("l40s"), perf("h100"), perf("l20")
    sdxl_unet, sdxl_component = forward(SDXL, "unet", guidance_scale=1.0)
    ltx, ltx_component = ltx_forward()
    leaf = cost.PIPEMAP
    flux = counts(FLUX)
    return [
        Row("L40S", "SDXL UNet, one forward 1024x1024 (batch 1), resident", 0.074, one_call(sdxl_unet, l40s),
            DIFFUSERS + ", sha dc778b0"),
        Row("L40S", "LTX-Video 0.9.7 transformer, one forward 512x704x161 frames, resident", 1.434,
            one_call(ltx, l40s), DIFFUSERS + ", sha 152f7ca"),
        Row("L40S", "SDXL UNet, one forward, group offload leaf_level + stream" + AFTER, 0.56,
            leaf_streamed(sdxl_unet, sdxl_component, runner(), 1, group_offload()),
            DIFFUSERS + " (diffusers repo, d3c494a)"),
        Row("L40S", "LTX-Video 0.9.7 transformer, one forward, group offload leaf_level + stream" + AFTER, 2.573,
            leaf_streamed(ltx, ltx_component, runner(), 1, group_offload()), DIFFUSERS + ", sha 3c7506b"),
        Row("H100", "FLUX.1-dev pipeline, 1024x1024, 50 steps, resident", 12.339, resident(flux, h100, 50), ORT),
        Row("H100", "FLUX.1-dev pipeline, 1024x1024, 50 steps, resident", 9.30, resident(flux, h100, 50),
            CACHE_DIT_H100),
        Row("H100", "FLUX.1-schnell pipeline (FLUX.1-dev's counts, 256 text tokens), 4 steps, resident", 1.120,
            resident(counts(FLUX, max_sequence_length=256), h100, 4), ORT),
        Row("H100", "SD 3.5 Large pipeline, 1024x1024, 50 steps, CFG, resident", 11.615,
            resident(counts(SD35), h100, 50), ORT),
        Row("H100", "Qwen-Image pipeline, 1024x1024, 50 steps, true CFG (negative prompt), resident", 18.49,
            resident(counts(QWEN, negative_prompt=" ", true_cfg_scale=4.0), h100), CACHE_DIT_H100),
        Row("H100", "FLUX.1-dev pipeline on 2 GPUs, 1024x1024, 50 steps, tokens split (cache-dit Ulysses-2; pipemap: "
            "sequence)" + THIRD, 6.04, as_run(FLUX, "h100", 2, num_inference_steps=50), CACHE_DIT_H100_PAIR),
        Row("H100", "Qwen-Image pipeline on 2 GPUs, 1024x1024, 50 steps, true CFG (negative prompt), tokens split "
            "(cache-dit Ulysses-2; pipemap: sequence)" + THIRD, 12.81,
            as_run(QWEN, "h100", 2, negative_prompt=" ", true_cfg_scale=4.0), CACHE_DIT_H100_PAIR),
        Row("H100", "FLUX.1-dev pipeline on 4 GPUs, tokens split (xDiT Ulysses-4; pipemap: {}) [added in issue "
            "50]".format(two_gpus(FLUX, "h100", gpus=4)[1]), 4.24, two_gpus(FLUX, "h100", gpus=4)[0], XDIT_FOUR),
        *(Row("H800", f"Qwen-Image pipeline{f' on {n} GPUs' if n > 1 else ''}, 2048x2048, 50 steps, true CFG, "
              + (f"tokens split (vLLM-Omni Ulysses-{n}; pipemap: sequence)" if n > 1 else "resident (diffusers)")
              + " [added in issue 50's second stop]", published, ulysses(QWEN, "h800", n, **QWEN_2048), VLLM_OMNI)
          for n, published in ((1, 112.5), (2, 65.2), (4, 39.6))),
        Row("L20", "FLUX.1-dev pipeline on 2 GPUs, tokens split (cache-dit Ulysses-2; pipemap: sequence) [added in "
            "issue 50's second stop]", 13.87, ulysses(FLUX, "l20", 2), CACHE_DIT_L20_PAIR),
        Row("L20", "FLUX.1-dev pipeline, resident (~38 GiB) [the L20's fit row until its share of 1.03 was dropped]",
            23.4, resident(flux, l20), CACHE_DIT),
        Row("L20", "FLUX.1-dev pipeline, diffusers model offload (~25 GiB)", 56,
            model_offload(FLUX, l20, DIFFUSERS_MODEL_OFFLOAD), CACHE_DIT),
        Row("L20", "FLUX.1-dev pipeline, cache-dit layerwise, synchronous copies (~1 GiB)" + AFTER, 49,
            pipeline_streamed(FLUX, l20, replace(leaf, overlap=False), {}, {}), CACHE_DIT),
        Row("L20", "FLUX.1-dev pipeline, cache-dit layerwise async: transformer 4 buckets, 32 persistent in 4 bins, "
            "prefetch limit (8 ahead); text encoders 1 bucket, 4 persistent (~16 GiB reserved)" + AFTER, 24.6,
            pipeline_streamed(FLUX, l20, leaf, {"transformer": 8}, {"transformer": (32, 4), "text_encoder": (4, 1),
                                                                    "text_encoder_2": (4, 1)}), CACHE_DIT),
        *video_rows(),
        *wan22_rows(),
        *other_rows(),
    ]


# ---- what sets a check row's price -------------------------------------------------------------------------------

# each fitted constant, how to scale it for a run of the rows: the GPU shares (a generation's default follows the
# share it is taken from), the launch constant, the runner's host link, the pageable share
FIT_GPU = {"hopper": "h100", "ampere": "a100", "ada": "l40s", "turing": "a100"}
TERMS = ("H100 share", "A100 share", "L40S share", "launch constant", "Hopper host launch", "runner host link",
         "pageable share", "straggler wait")
ELASTIC = 0.3  # a term sets a row's price when 10% on it moves the row by 3% or more
MODELS = ("SD 1.5", "SDXL", "SD 3.5 Large", "FLUX.1", "Qwen-Image", "LTX-Video", "Wan 2.1 T2V-14B",
          "Wan 2.1 T2V-1.3B", "Wan 2.2 T2V-A14B", "Wan 2.2 TI2V-5B", "HunyuanVideo", "SANA 1600M")


@contextlib.contextmanager
def scaled(term: str, factor: float):
    """The fitted constant ``term`` times ``factor`` while the rows are priced."""
    global RUNNER_HOST_BANDWIDTH
    saved = (hardware.sustained_share, hardware.KERNEL_SECONDS, RUNNER_HOST_BANDWIDTH, cost.PAGEABLE_SHARE,
             cost.STRAGGLER_WAIT)
    hosts = dict(hardware.HOST_LAUNCH)
    if term.endswith(" share") and term != "pageable share":
        fitted = term.split()[0].lower()

        def share(gpu: str) -> tuple[float, str]:
            value, origin = saved[0](gpu)
            source = gpu if gpu in hardware.SUSTAINED else FIT_GPU[hardware.GENERATION[gpu]]
            return (value * factor if source == fitted else value), origin

        hardware.sustained_share = share
    elif term == "launch constant":
        hardware.KERNEL_SECONDS = saved[1] * factor
    elif term == "Hopper host launch":
        hardware.HOST_LAUNCH.update({k: v * factor for k, v in hosts.items()})
    elif term == "runner host link":
        RUNNER_HOST_BANDWIDTH = saved[2] * factor
    elif term == "pageable share":
        cost.PAGEABLE_SHARE = saved[3] * factor
    elif term == "straggler wait":
        cost.STRAGGLER_WAIT = saved[4] * factor
    try:
        yield
    finally:
        (hardware.sustained_share, hardware.KERNEL_SECONDS, RUNNER_HOST_BANDWIDTH, cost.PAGEABLE_SHARE,
         cost.STRAGGLER_WAIT) = saved
        hardware.HOST_LAUNCH.update(hosts)


def labelled(checks: list[Row], fits: list[Row]) -> list[Row]:
    """Each check row labelled independent or repeat (the same GPU and model as a fit row), with the fitted
    constants whose 10% moves its price by 3% or more."""
    fitted = {(r.gpu, model_of(r.setup)) for r in fits}
    moved: dict[str, list[float]] = {}
    for term in TERMS:
        with scaled(term, 1.1):
            moved[term] = [row.predicted for row in check_rows()]
    out = []
    for i, row in enumerate(checks):
        terms = [t for t in TERMS if abs(moved[t][i] / row.predicted - 1) >= ELASTIC * 0.1]
        label = "repeat" if (row.gpu, model_of(row.setup)) in fitted else "independent"
        out.append(replace(row, model=model_of(row.setup), label=label, terms=", ".join(terms) or "none fitted"))
    return out


def model_of(setup: str) -> str:
    return next((m for m in MODELS if setup.startswith(m)), setup.split(",")[0])


def bands(checks: list[Row]) -> list[str]:
    lines = ["| label | rows | within 0.8-1.25x | within 0.67-1.5x | lowest | highest |",
             "|---|---:|---:|---:|---:|---:|"]
    for label in ("independent", "repeat"):
        ratios = [r.ratio for r in checks if r.label == label]
        if ratios:
            lines.append(f"| {label} | {len(ratios)} | {sum(0.8 <= x <= 1.25 for x in ratios)} | "
                         f"{sum(0.67 <= x <= 1.5 for x in ratios)} | {min(ratios):.2f} | {max(ratios):.2f} |")
    return lines


def by_source(checks: list[Row]) -> list[str]:
    """The independent rows by the table they come from: a few tables give most of them, and a table's rows share
    its stack, so the share per source says more than the pooled one."""
    sources: dict[str, list[float]] = {}
    for row in checks:
        if row.label == "independent":
            sources.setdefault(row.source.split(" (")[0], []).append(row.ratio)
    lines = ["| source | independent rows | within 0.8-1.25x | lowest | highest |", "|---|---:|---:|---:|---:|"]
    for source, ratios in sources.items():
        lines.append(f"| {source} | {len(ratios)} | {sum(0.8 <= x <= 1.25 for x in ratios)} | {min(ratios):.2f} | "
                     f"{max(ratios):.2f} |")
    return lines


DROPPED = [
    ("H800/H100, A800/A100, H20", "Wan 2.1 I2V-14B at 720P on 1/2/4/8 GPUs (the Wan 2.1 README's table), and the "
     "Wan 2.1 official repo's I2V-14B at 480P and 720P on one H200 (LightX2V's benchmark, "
     "https://github.com/ModelTC/LightX2V docs/EN/source/getting_started/benchmark_source.md: 366 s and 974 s, 40 "
     "steps)", "the catalog has no image-to-video Wan: its CLIP image encoder, the conditioning video's VAE encoding "
     "and the image tokens' cross-attention would be priced as the text-to-video pipeline's, which they are not"),
    ("A100", "SANA 1600M 4Kpx at 4096x4096 on 2 GPUs with PipeFusion (11.276 s) or Ring-2 (11.447 s), and on 4 and "
     "8 GPUs (CFG-2 with PipeFusion, Ring or Ulysses: 3.991-5.803 s; xDiT's sana.md)", "PipeFusion and ring attention "
     "are not priced (pipemap's splits are Ulysses, guidance branches and batch parts), nor a batch cut in two with "
     "each half's tokens split"),
    ("H100/H800, A100/A800, H20, 4090", "Wan 2.2 I2V-A14B at 480P and 720P and TI2V-5B I2V at 720P on 1/4/8 GPUs "
     "(the Wan 2.2 README's table)", "image to video: the catalog has no image-to-video Wan 2.2 pipeline (the I2V "
     "experts' image conditioning, the 5B's image latents)"),
    ("4090", "Wan 2.1 T2V-1.3B at 480P on 8 GPUs (the Wan 2.1 README's table: 112.3 s)", "run with ring attention "
     "(--ring_size 8: 12 heads do not divide by 8), which pipemap does not price (its sequence split is Ulysses)"),
    ("L20", "cache-dit layerwise async, 1 bucket (~4 GiB), + 4 persistent (~8 GiB), 4 buckets + 8 persistent "
     "(~14 GiB): 41 s, 33 s, 26 s", "without a prefetch limit cache-dit prefetches as far ahead as its runtime "
     "decides ('may aggressively prefetch many future targets'), over copy lanes sized by an internal cap: the "
     "window those runs had is not published, so they cannot be modelled as they ran. The same bytes cross the link "
     "at every step in all three (the persistent leaves hold 39 MiB to 0.3 GiB; the GiB figures are torch's "
     "reserved peaks)"),
]


def formula_rates() -> list[str]:
    """The formula's rates, derived: medians over the catalog's recorded counts."""
    per_flop, denoisers, others = [], [], []
    for name in catalog.names():
        found, inventory = catalog.recorded_counts(name), pipemap.inspect(name)
        for component in inventory.models:
            if found.get(component.name) is None:
                continue
            work = found[component.name].per_call(found.iterations())
            (denoisers if component.name in cost.PER_STEP else others).append(work.kernels / cost._modules(component))
            if component.name in cost.PER_STEP:  # per FLOP outside fused attention, which moves none through them
                per_flop.append(work.memory_bytes / (work.flops - work.attention_flops))
    rates = (("MEMORY_BYTES_PER_FLOP", statistics.median(per_flop), cost.MEMORY_BYTES_PER_FLOP),
             ("KERNELS_PER_MODULE", statistics.median(denoisers), cost.KERNELS_PER_MODULE),
             ("KERNELS_PER_MODULE_ONCE", statistics.median(others), cost.KERNELS_PER_MODULE_ONCE))
    for name, found_rate, used in rates:
        if abs(used / found_rate - 1) > ROUNDING:
            print(f"WARNING: cost.{name} is {used:g} in the code, the catalog's median is {found_rate:.4g}")
    return [f"`cost.{name}` = {used:g} (median over the record: {found_rate:.3g})" for name, found_rate, used in rates]


def formula_table() -> list[str]:
    """The formula's FLOPs (what prices a folder no dry run has counted) against the counts, per catalog denoiser."""
    lines = ["| pipeline | denoiser | counted TFLOP a step | formula TFLOP a step | formula/counted |",
             "|---|---|---:|---:|---:|"]
    for name in catalog.names():
        found = catalog.recorded_counts(name)
        inventory = pipemap.inspect(name)
        work = replace(cost.workload_for(inventory), steps=found.steps)
        for component in inventory.models:
            if component.name not in cost.PER_STEP or found.get(component.name) is None:
                continue
            counted = found[component.name].per_step.flops
            formula = cost.formula_component(component, cost._dtype_bytes(inventory.dtype), work).per_step.flops
            lines.append(f"| {name} | {component.name} | {counted / 1e12:.1f} | {formula / 1e12:.1f} | "
                         f"{formula / counted:.2f} |")
    return lines


def table(rows: list[Row], fitted: bool) -> list[str]:
    extra = "fits | " if fitted else "label | priced by | "
    head = "| GPU | setup | published s | predicted s | predicted/published | " + extra
    lines = [head + "source |", "|---|---|---:|---:|---:|" + ("---|" if fitted else "---|---|") + "---|"]
    for row in rows:
        flag = "" if fitted or 0.8 <= row.ratio <= 1.25 else " (outside 0.8-1.25)"
        fits = f"{row.fits} | " if fitted else f"{row.label} | {row.terms} | "
        lines.append(f"| {row.gpu} | {row.setup} | {row.published:g} | {row.predicted:.3g} | {row.ratio:.2f}{flag} | "
                     f"{fits}{row.source} |")
    return lines


FIRST_RUN = {"SDXL UNet, group offload": 2.95, "LTX-Video transformer, group offload": 0.77,
             "cache-dit layerwise, synchronous": 1.56, "cache-dit layerwise async, prefetch limit": 2.06}


def flops_table() -> list[str]:
    """The counter's FLOPs for one forward against the FLOPs diffusers' benchmark publishes for it (torch's FLOP
    counter on the real GPU forward)."""
    lines = ["| model, one forward | counted GFLOP | published GFLOP | counted/published |", "|---|---:|---:|---:|"]
    for label, work, published in (("FLUX.1-dev transformer, 1024x1024, 512 text tokens",
                                     forward(FLUX, "transformer")[0], 74395.44),
                                    ("LTX-Video 0.9.7 transformer, 512x704x161", ltx_forward()[0], 212025.96),
                                    ("SDXL UNet, 1024x1024, batch 1", forward(SDXL, "unet", guidance_scale=1.0)[0],
                                     5979.1)):
        flops = work.per_call(1).flops / 1e9
        lines.append(f"| {label} | {flops:.0f} | {published:g} | {flops / published:.3f} |")
    return lines


def gpu_table() -> list[str]:
    """Every GPU the cost model knows: its datasheet figures, links, share and host launch default, with where each
    comes from (``hardware``)."""
    lines = ["| GPU | generation | bf16 dense TFLOP/s | vector FP32 TFLOP/s | memory TB/s | host link GB/s | "
             "peer link GB/s | sustained share (memory) | tensor share | FlashAttention-2 share | host launch us |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for gpu, (flops, memory, host, peer) in hardware.GPU_PERFORMANCE.items():
        share, origin = hardware.sustained_share(gpu)
        launch, launch_origin = hardware.launch_default(gpu)
        flash = hardware.attention_rate(gpu, "flash")[0] / flops
        lines.append(f"| {gpu.upper()} | {hardware.GENERATION[gpu]} | {flops / 1e12:g} | "
                     f"{hardware.VECTOR_FLOPS[gpu] / 1e12:g} | {memory / 1e12:.3g} | {host / 1e9:.3g} | "
                     f"{peer / 1e9:.3g} | {share:.3f} ({origin}) | {hardware.tensor_share(gpu)[0]:.3f} | "
                     f"{flash:.3f} | {launch * 1e6:.1f} ({launch_origin}) |")
    return lines


def independent_share(checks: list[Row]) -> str:
    """The line saying how many independent check rows land within 0.8-1.25x, printed and kept in RESULTS.md."""
    ratios = [r.ratio for r in checks if r.label == "independent"]
    inside = sum(0.8 <= x <= 1.25 for x in ratios)
    return (f"independent check rows within 0.8-1.25x: {inside} of {len(ratios)} ({inside / max(1, len(ratios)):.1%}"
            "; the goal is at least 90%)")


def append_results(line: str, checks: list[Row]) -> None:
    rows = "\n".join(f"| {r.gpu} | {r.setup} | {r.ratio:.2f} | {r.label} |" for r in checks)
    text = (f"\n## bench/calibration.py\n\n{line}\n\n| GPU | setup | predicted/published | label |\n"
            f"|---|---|---:|---|\n{rows}\n")
    with Path(__file__).with_name("RESULTS.md").open("a") as results:
        results.write(text)


def main() -> None:
    fits = fit_rows()
    checks = labelled(check_rows(), fits)
    share_line = independent_share(checks)
    inside = sum(0.8 <= r.ratio <= 1.25 for r in checks)
    gpus = sorted({r.gpu for r in checks})
    text = "\n".join([
        "# Cost model calibration",
        "",
        "Generated by `python bench/calibration.py`. The model (`pipemap.cost`): each component's FLOPs, memory-bound"
        " bytes and kernel launches, counted by a dry run at the setup's own shapes (`pipemap.dryrun.counter`; the "
        "catalog's record for a default call), priced as the longer of the GPU's time (FLOPs over sustained FLOP/s, "
        "float32 operands at half, fused attention at its backend's published rate (`hardware.ATTENTION_SHARE`: "
        "FlashAttention-2 unless a row says otherwise), plus memory-bound bytes over sustained memory bandwidth) and "
        "the host's time launching the kernels (each GPU launches every kernel of its share of a call cut across "
        "GPUs); copies as bytes over the link plus a latency each; a streamed component's copies overlapping its "
        "compute as its streams allow (prefetch depth, buffers). A GPU's sustained figures are its datasheet dense "
        "bf16 FLOP/s and memory bandwidth (`hardware.GPU_PERFORMANCE`) times its share (`hardware.SUSTAINED`); the "
        "links are measured figures, not spec sheets (PCIe 4.0 x16 25 GB/s, PCIe 5.0 44 GB/s, NVLink at 0.82 of its "
        "line rate through NCCL: see the GPU table below). Each setup is priced with the mechanism the source used "
        "(pinned or pageable copies, overlapped or not, copied back or not, leaf by leaf or by pipemap's pieces).",
        "",
        "## Fitted: each constant and the one published figure it is fitted on",
        "",
        "Eager PyTorch reaches very different shares of the datasheet on different GPUs (FLUX.1-dev: 0.62 of an "
        "H100's, 0.92 of an L40S's, attention apart), so three GPUs, one of each generation, have their share, fitted"
        " on one FLUX.1-dev row (the A100's on SDXL, with the kernel overhead on SD 1.5); the check rows then put "
        "other architectures, mechanisms and GPUs on them. A GPU without a fitted share takes its generation's "
        "(`hardware.GENERATION_SHARE`: the L20 and 4090 the L40S's, the H200 and H20 the H100's, the 3090 and A6000 "
        "the A100's; Turing, with no fit, Ampere's), moved to it by its own tensor and vector rates "
        "(`hardware.moved_share`, from datasheet figures: the H20 0.88 of its peak, the H200 the H100's 0.62; its "
        "memory keeps the generation's share), and its figures say so (`Performance.origin`). The L20's own fit "
        "(1.03 of its datasheet: not physical) was dropped; its row is a check row now. The script solves each "
        "constant from its row and warns when the code's constant is not that value.",
        "",
        *table(fits, True),
        "",
        "## Checked: published figures nothing was fitted on",
        "",
        f"{inside} of {len(checks)} rows within 0.8x-1.25x, on {len(gpus)} GPUs ({', '.join(gpus)}), across a UNet "
        "(SDXL), MMDiT and dual-stream transformers (SD 3.5 Large, FLUX.1, Qwen-Image), a linear-attention "
        "transformer (SANA) and video transformers (LTX-Video 0.9.7, Wan 2.1, HunyuanVideo).",
        "",
        *table(checks, False),
        "",
        f"**{share_line}.**",
        "",
        "Each check row is labelled independent (no fit row runs its model on its GPU) or repeat (one does), and "
        "priced by the fitted constants a 10% change of which moves it 3% or more (none: only datasheet figures "
        "and counts). The band per label:",
        "",
        *bands(checks),
        "",
        "The independent rows by source:",
        "",
        *by_source(checks),
        "",
        "How it was made, and what is outside the band:",
        "",
        "- The order of events, since the rows were seen along the way. An earlier version priced compute as the "
        "GPU's time plus the launches' and had one share for every GPU; its fit asked for a share above 1, and a "
        "run with stale constants (a share of 0.73) put the check rows at 0.57x-1.41x. After that run the host's "
        "launches became overlapped with the GPU's work (the longer of the two) and each GPU got its own share "
        "(the fit rows alone show why: FLUX.1-dev needs 0.57 of an H100 and 0.89 of an L40S). No constant was "
        "fitted again after a check row was seen. Four rows' mechanisms were modelled again after the first run of "
        "this model (marked): it gave diffusers' group offload a fitted per-leaf hook latency and cache-dit's "
        "layerwise offload the same one, and its ratios were "
        + ", ".join(f"{k} {v:.2f}" for k, v in FIRST_RUN.items())
        + ". A constant per-leaf latency fits none of the three group-offload rows together; the three are "
        "consistent with a slower host link on diffusers' runner (fitted on the FLUX.1-dev row), and cache-dit's "
        "rows with pipemap's own 10 us a copy. They are no longer blind checks. (A bug was fixed in the same "
        "pass: leaf rows read the catalog's record, which keeps three levels of modules, and gave leaves no "
        "compute; they now count each pipeline anew.)",
        "- Issue 37, in this order: the check rows above were committed with the labels first (the L20's fit "
        "dropped, it takes Ada's share); then attention became a work class of its own, priced at the published "
        "rate of the backend each source's stack ran (`hardware.ATTENTION_SHARE`: FlashAttention-2, what PyTorch's "
        "SDPA picks for 16-bit inputs without a mask), and the three GPU shares were fitted again on their own "
        "rows (H100 0.573 -> 0.622, A100 0.497 -> 0.483, L40S 0.891 -> 0.917); a boolean mask is counted as the "
        "fused kernel runs it (Qwen-Image's text encoder: 1604 -> 1296 kernels a call); a call cut across two GPUs "
        "shares the GPU's work but not the host's launches. The two-GPU row was added after that: it checks the "
        "host term, not blindly.",
        "- Issue 37's leftovers, in this order, with the check rows as committed before (the two group-offload rows "
        "at 0.73 and 0.79). Offload is priced as each tool runs it. diffusers' group offload waits on the host at "
        "every leaf (`stream.synchronize()` before it starts the next leaf's copy, "
        "`current_stream().synchronize()` after the leaf's forward unless record_stream), so a copy hides behind "
        "one leaf's compute only (`cost.waiting_call_seconds`, `Mechanism.waits`); the link and the GPU idle while "
        "its hook's Python runs, 126 us a leaf as measured on this VM (diffusers' leaf-level hooks on 400 tiny "
        "Linear leaves, less the same model without them: a measurement, not a fit). The runner's host link was "
        "then fitted again on the FLUX.1-dev row alone (12.85 -> 16.5 GB/s). A streamed copy also waits for the "
        "host to ask for it (pipemap's hooks ask as the host enters the piece `depth` before: late when launches "
        "set the pace). After this the two group-offload rows read 0.88 and 0.99. The per-leaf time was looked at "
        "over 60-200 us against the check rows before the measured 126 us was kept: 60 us gives SDXL 0.77, 200 us "
        "1.00, LTX-Video 0.99 throughout.",
        "- FLUX.1-dev at 50 steps on an H100 is published twice: 12.34 s (ONNX Runtime's PyTorch 2.5.1 eager "
        "baseline) and 9.30 s (cache-dit's baseline): 1.33x apart for one setup, so one prediction sits near one "
        "of them.",
        "- Outside the band, each with its reason. SD 3.5 Large on an H100 (0.77; 0.75 before attention was "
        "priced apart): the H100's share is fitted on FLUX.1-dev, whose memory-bound bytes per FLOP are 1.4x SD 3.5 "
        "Large's, and one share prices both: the split between FLOP time and memory time is where the model is "
        "weakest. FLUX.1-dev on an H100 against cache-dit's baseline (1.28): the same setup's other source is 1.33x "
        "slower (above), and the prediction sits 0.97x of that one. Qwen-Image on "
        "an H100 (1.19) and the SDXL UNet on the L40S (1.01) are set by the launch constant fitted on one A100: "
        "they check the host, not the GPU.",
        "- Issue 50, in this order, the check rows seen before (the 2-GPU FLUX.1-dev row at 1.09, Qwen-Image on "
        "an H100 at 1.19). The links became measured figures (NVLink 4 300 -> 370 GB/s one way, PCIe 5 50 -> 44 "
        "GB/s). A sequence split's exchanges grew what scales with the ranks: each collective's latency by "
        "`cost.RANK_LATENCY` (10 us) a rank beyond two, and the permute copies around each all-to-all "
        "(`cost.PERMUTE_SHARE`: 38% of the exchange's time on an H100, pytorch/pytorch#178066); neither is fitted. "
        "Then the host's launch cost got a default per GPU class (`hardware.HOST_LAUNCH`): the Hopper (and, "
        "without a figure of its own, Blackwell) hosts' fitted on xDiT's 2-GPU FLUX.1-dev row, which moved from the "
        "check rows to the fit rows; every other class keeps the A100 host's `KERNEL_SECONDS`. Qwen-Image at "
        "1024x1024 on one H100 is not launch-bound enough to fit it on: its GPU time alone (19.2 s at the H100's "
        "share) is above cache-dit's 18.49 s, whose stack is faster than xDiT's and ONNX Runtime's (FLUX.1-dev: "
        "9.30 s against 12.34 s at 50 steps). A spec states a host's figure with `launch=12us`; `pipemap doctor` "
        "measures this machine's.",
        "- The formula (what prices a call no dry run has counted) priced a transformer's attention FLOPs at the "
        "dense rate and gave them memory-bound bytes at the median rate per FLOP: at Wan's 75,600 tokens (1280x720x81) "
        "about 4 TB a call that no fused kernel moves. Its attention is now a work class of its own, as in the counts "
        "(at the backend's rate), and `cost.MEMORY_BYTES_PER_FLOP` is a rate per FLOP outside attention (0.0019 -> "
        "0.0025, the catalog's median). No check row is priced by the formula.",
        "- xDiT's Ulysses-4 row (4.24 s on 4 H100s, against 4.38 s on 2: eager PyTorch gains little from the "
        "third and fourth GPU, while torch.compile, which removes most launches, gives 1.63 s) was read and added "
        "as a check row after the fits: the model's 4-GPU FLUX.1-dev is launch-bound as that run is.",
        "- Issue 50's second stop, in this order. The published 2/4/8-GPU rows were read from their sources: "
        "vLLM-Omni's Qwen-Image at 2048x2048 is Ulysses-SP over 2, 4 and 8 H800s (not CFG parallel with Ulysses "
        "inside, as issue 50 had quoted it), 112.5 / 65.2 / 39.6 / 30.8 s; priced as run (H800: the H100's share, "
        "cut NVLink; two transformer calls a step, as its 1-GPU time says: one call a step would put that row at "
        "0.53) the model gave 1.07 / 1.03 / 0.92 / 0.79 before any change. Two terms were then added: each exchange's "
        "own host work on every rank (`cost.EXCHANGE_LAUNCHES` = 3 launches: the permute copy in, the collective, the "
        "copy back, as diffusers' Ulysses attention runs them; not fitted, but it moved the Hopper host's launch, "
        "fitted on xDiT's 2-GPU row, from 36.2 to 30.6 us, so no row moved by it); and load imbalance "
        "(`cost.RANK_IMBALANCE`: the slowest rank's GPU work, a share more for every rank beyond two), fitted on the "
        "8-GPU row, which makes the other three Qwen-Image rows on the H800 repeats. A fixed latency per collective "
        "and rank fitted on the same row was tried first: it slowed xDiT's 4-GPU FLUX.1-dev to 1.18 (eager FLUX.1-dev "
        "is launch-bound from 2 ranks on, and gains a little from 2 to 4 GPUs), so the wait went onto the GPU's work, "
        "where a host that sets the pace hides it. A soft maximum of the host's and the GPU's time (p = 2, 3, 4) "
        "was tried and dropped: refitted on the 2-GPU row it made xDiT's 4-GPU row 0.86-0.91 and moved Qwen-Image's "
        "8-GPU row by less than 0.05. The Amdahl reading of vLLM-Omni's rows (about 18 s that does not shrink with "
        "the ranks) has no single term behind it here: the VAE and text encoder are priced at 0.3 s.",
        "- Issue 50's third stop, in this order. Read first, and priced with the model as it stood (`RANK_IMBALANCE` "
        "0.114, the H20 at the H100's share, HunyuanVideo priced as two calls a step for want of a default call): the"
        " Wan 2.1 README's table (T2V-14B at 720P on 1/2/4/8 GPUs: H100 1.05 / 1.04 / 1.22 / 1.45, A100 1.18 / 1.17 /"
        " 1.41 / 1.83, H20 1.63 / 1.63 / 1.97 / 2.45; T2V-1.3B on 4090s 1.13 / 0.94 / 0.95), xDiT's HunyuanVideo "
        "table at 1280x720 (H100 0.93 / 0.99 / 1.10 / 1.16, H20 1.67 / 1.65 / 1.96 / 2.53, L20 1.22 / 1.22 / 1.20) "
        "and cache-dit's 2xH100 runs (FLUX.1-dev 1.29, Qwen-Image 1.63): 20 of 33 independent rows within the band. "
        "Three changes followed, none fitted on these rows. (1) A share of a rank's work per rank beyond two "
        "(`RANK_IMBALANCE`) made Wan's 8-GPU runs 1.45-2.45x the published times; the straggler cost became a wait "
        "per collective and rank beyond two (`cost.STRAGGLER_WAIT`), on the GPU's side as before, fitted again on "
        "vLLM-Omni's 8-GPU row (71 us): short sequences over many ranks pay it (Qwen-Image at 2048x2048), long video "
        "sequences hardly; the Hopper host's fit on xDiT's 2-GPU row is unchanged (30.6 us) and vLLM-Omni's 2 and "
        "4-GPU rows went 1.03 / 1.09 -> 1.03 / 1.01. A share by tokens a rank (a kernel's partial last wave) was "
        "tried first and dropped: fitted on the same row (about 1,800 tokens) it made xDiT's 2-GPU FLUX.1-dev "
        "GPU-bound at 4.83 s against 4.38. Adding a share of the work as well, beside the wait, trades HunyuanVideo's"
        " 8xH100 row against Wan's 8xA100 (a share of 0.02 a rank: 0.79 and 1.25; 0.04: 0.86 and 1.37), so none was "
        "kept. (2) The H20 (148 dense TFLOP/s, a throttled Hopper) sustained far more of its peak than the H100's "
        "share says: a GPU without a fit now takes its generation's share moved by its tensor-to-vector ratio "
        "(`hardware.moved_share`: a FLOP's time is one at the tensor peak plus the rest of its kernel on the CUDA "
        "cores, in the fitted GPU's proportion; datasheet FP32 rates in `hardware.VECTOR_FLOPS`, nothing fitted), "
        "FlashAttention's rate likewise (the H20 0.70 of its peak where the H100 runs 0.35); the L20 and 4090 move to"
        " 0.96 of their peaks (their FLUX.1-dev rows: 1.18 -> 1.12 resident, 1.23 -> 1.18 on two). (3) HunyuanVideo "
        "got its diffusers default call (`cost.PIPELINE_DEFAULTS`: 1280x720x129, 50 steps, guidance embedded: one "
        "call a step), which halves its exchanges. Read after these changes and priced once, nothing changed after: "
        "xDiT's HunyuanVideo table at 960x960 on 1/2/3/6 GPUs, ParaAttention's L20 baselines, xDiT's SANA at "
        "4096x4096 on A100s and the Wan 2.2 README's table (T2V-A14B at 480P and 720P on H100, A100 and H20 over "
        "1/4/8 GPUs, its two experts each split as the other; FlashAttention-3 on the Hopper GPUs, as the README says"
        " the runs used; TI2V-5B text-to-video on 4090s): 34 of their 36 independent rows within the band. The Wan "
        "2.1 and 2.2 READMEs' image-to-video rows and LightX2V's H200 table (the Wan 2.1 official repo's I2V) are "
        "dropped (below): no image-to-video Wan in the catalog.",
        "- Outside the band after issue 50's third stop, each with its reason as far as it is known. HunyuanVideo on "
        "8 H100s (0.71): the published runs scale 1.00 / 2.06 / 3.70 / 5.64 over 1 / 2 / 4 / 8 GPUs, about 100 s more"
        " at 8 than the model's exchanges and waits; the VAE decode at 1280x720x129 (3,000 TFLOP of 3D convolutions, "
        "priced at 7 s) would be the serial part if it ran at a tenth of the priced rate, which no published figure "
        "here isolates. Wan 2.1 T2V-1.3B on 4 4090s (0.77): GeForce has no peer-to-peer, and NCCL's all-to-all "
        "through the host on that machine's PCIe topology is likely slower than the 20 GB/s priced; the 2-GPU row is "
        "0.86. Qwen-Image on 2 H100s under cache-dit (1.63): cache-dit's stack is faster than the one the Hopper "
        "constants are fitted on (its 1-GPU FLUX.1-dev is 1.28 of the price, its 2-GPU 1.29), and at 2 ranks the "
        "model is launch-bound (5,434 kernels a call at 30.6 us: 166 ms a call, above the published 128 ms): a host "
        "of about 20 us a launch, which a spec can state (`launch=`), would price it. SANA on 2 A100s with CFG "
        "parallel (1.27): the published 2-GPU run is 2.1x its 1-GPU run. Wan 2.2 TI2V-5B on 4 4090s (1.30; 1.23 on "
        "8): the call's tokens are counted as an 8x VAE and 2x2 patches make them (`Workload.latent_tokens`: 16 "
        "pixels a token), and the 5B's VAE compresses 16x (32 pixels a token), so its exchanges are priced at 4 times"
        " their bytes; at a quarter the two rows would be 0.91 and 0.89. The Workload needs the VAE's compression "
        "(its config's `scale_factor_spatial`), which the inventory does not carry yet. SD 3.5 Large on an H100 "
        "(0.77): as before; FlashAttention-2 at head dim 64 runs 0.87 of head dim 128 on an H100 at 4k tokens (321 "
        "against 368 TFLOP/s, the FlashAttention-3 paper's Figure 5, arXiv:2407.08608), which would put it at 0.80 if"
        " the rate followed the head dim (not done: the rate would need each component's head dim); sequence length "
        "moves FlashAttention-2's rate by 2% or less above 2k tokens there, so long video sequences are not priced "
        "apart.",
        "",
        "## The GPU table",
        "",
        "Datasheet figures (dense bf16 tensor FLOP/s, no sparsity; GeForce at FP32 accumulate) and memory bandwidth "
        "from each vendor's datasheet; links as measured, not spec sheets: PCIe 4.0 x16 about 25 GB/s of 32; "
        "PCIe 5.0 x16 35-53 GB/s by direction and copy engine (priced at 44, the middle); NVLink through NCCL at "
        "0.82 of its line rate one way ('with the protocol overhead (~20%) NCCL can get an effective NVLink "
        "bandwidth of 370GB/s', NVIDIA/nccl-tests#212: NVLink 4's 450), NVLink 5 (B200) and the H800's and A800's "
        "cut NVLink at that share; the A100's NVLink 3 at the ~200 GB/s nccl-tests shows on 8xA100 "
        "(NVIDIA/nccl-tests#149, #178); GeForce has no peer-to-peer: copies through the host at 0.8 of its link; "
        "an MI300X pair shares one xGMI link (64 GB/s one way) at NVLink's 0.82 (8 GPUs use all 7 links: priced "
        "as a pair, pessimistic). A GPU without a fitted share takes its generation's, saying so; the host launch "
        "default is its class's (`hardware.HOST_LAUNCH`) or the A100 host's.",
        "",
        *gpu_table(),
        "",
        "Dropped, with the reason:",
        "",
        *(f"- {gpu}, {setup}: {why}." for gpu, setup, why in DROPPED),
        "",
        "## The counts against published counts",
        "",
        "diffusers' benchmark publishes the FLOPs of the forward it times; the dry run's count of the same forward "
        "(stand-in tensors, no weights) beside it:",
        "",
        *flops_table(),
        "",
        "(SDXL's published 5979.1 comes from the runs whose FLUX.1-dev figure was 59523 GFLOP, a count without "
        "attention; FLUX.1-dev's later 74395 adds it.)",
        "",
        "## The formula a folder is priced by until a dry run counts it",
        "",
        "`cost.formula_counts`: 2 FLOPs per parameter per position it acts on (a transformer's image-stream weights "
        "on the image tokens, its text-stream weights on the text tokens and its modulation layers on one, read "
        "from diffusers' module names; a UNet's blocks at their resolution), attention over image and text tokens; "
        "memory-bound bytes and kernels at the catalog's median rates (" + "; ".join(formula_rates()) + "). "
        "Against the counts, at each catalog pipeline's default call:",
        "",
        *formula_table(),
        "",
    ])
    Path(__file__).with_name("CALIBRATION.md").write_text(text)
    append_results(share_line, checks)
    print(text)
    print(share_line)


if __name__ == "__main__":
    main()
