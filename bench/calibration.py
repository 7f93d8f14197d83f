"""The cost model against published measurements: each row a setup someone measured (GPU, model, resolution, steps,
offload mode), the model's prediction for the same setup beside it, and the ratio. Writes bench/CALIBRATION.md.

    python bench/calibration.py            # regenerates bench/CALIBRATION.md and prints it

The published figures are data here, each with its source. A row's setup is planned with pipemap's own planner at
the memory the source reports and priced with the mechanism the source used (``cost.Mechanism``: pinned or pageable
copies, overlapped or not, copied back or not). Where a ratio falls outside 0.67x-1.5x the model is what to fix
(per-GPU figures in ``hardware.GPU_PERFORMANCE``, the constants in ``cost.py``), not the table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

import pipemap
from pipemap.cost import PIPEMAP, Mechanism, Workload, component_cost, seconds_per_image, workload_for
from pipemap.inventory import Inventory
from pipemap.plan import Placement

CACHE_DIT = ("https://github.com/vipshop/cache-dit/blob/810b1f93/docs/user_guide/OFFLOAD.md "
             "(NVIDIA L20, FLUX.1-dev, 28 steps, 1024x1024)")
DIFFUSERS = ("https://huggingface.co/datasets/diffusers/benchmarks (collated_results.csv, sha 152f7ca / dc778b0; "
             "runner aws-g6e-4xlarge = L40S, benchmarks/benchmarking_*.py: one denoiser forward, bf16)")
XDIT = ("https://github.com/xdit-project/xDiT/blob/main/docs/performance/flux.md "
        "(FLUX.1-dev, 28 steps, 1024px, 1 GPU, PyTorch without torch.compile)")

DIFFUSERS_SEQUENTIAL = Mechanism(pinned=False, overlap=False)  # accelerate's AlignDevicesHook: .to() per module
DIFFUSERS_MODEL_OFFLOAD = Mechanism(pinned=False, overlap=False, copy_back=True)  # CpuOffload: in and back out
SYNC_PINNED = Mechanism(pinned=True, overlap=False)  # cache-dit layerwise without async transfer
# diffusers' leaf-level group offload with use_stream: pinned, prefetched, but one onload per leaf module with
# Python bookkeeping around it, ~0.2 ms a leaf (the one figure this row adds; ~1000 leaves in Flux's transformer)
GROUP_OFFLOAD_LEAF_LATENCY = 200e-6


@dataclass(frozen=True)
class Row:
    source: str
    gpu: str
    setup: str
    published: float
    predicted: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def _hardware(gpu: str, gib: float) -> pipemap.Hardware:
    return pipemap.Hardware.parse(f"cuda:0={int(gib * 2**30)},cpu=256GiB,gpu={gpu}")


def pipeline_seconds(name: str, gpu: str, gib: float, strategy: str, mechanism: Mechanism = PIPEMAP,
                     ahead: int | None = None) -> float:
    """Seconds per image of a catalog pipeline planned by ``strategy`` on one GPU of ``gib`` GiB (no headroom),
    with ``ahead`` pieces prefetched where the source fixed it."""
    inventory = pipemap.inspect(name, dtype=torch.bfloat16)
    hardware = _hardware(gpu, gib)
    plan = pipemap.plan(inventory, hardware=hardware, strategy=strategy, headroom=0.0)
    if ahead is not None:
        plan = replace(plan, components=tuple(replace(p, prefetch=ahead) if p.mode == "stream" else p
                                              for p in plan.components))
    return seconds_per_image(plan, inventory, hardware.performance, mechanism=mechanism)


def model_offload_seconds(name: str, gpu: str, mechanism: Mechanism) -> float:
    """diffusers' enable_model_cpu_offload: every model moved in at its call (and back out after)."""
    inventory = pipemap.inspect(name, dtype=torch.bfloat16)
    hardware = _hardware(gpu, 48)
    plan = pipemap.plan(inventory, hardware=hardware, strategy="balanced", headroom=0.0)
    plan = replace(plan, components=tuple(Placement(p.component, "cpu", p.bytes, "offload", "cuda:0")
                                          for p in plan.components))
    return seconds_per_image(plan, inventory, hardware.performance, mechanism=mechanism)


def one_call_seconds(name: str, component: str, gpu: str, gib: float | None = None, latency: float = 0.0) -> float:
    """One forward of a pipeline's denoiser at its default resolution: resident, or streamed within ``gib`` GiB
    with ``latency`` seconds more per copy."""
    full = pipemap.inspect(name, dtype=torch.bfloat16)
    inventory = Inventory(full.source, full.pipeline_class, (full[component],), full.dtype)
    hardware = _hardware(gpu, gib if gib is not None else 80)
    plan = pipemap.plan(inventory, hardware=hardware, strategy="balanced_ultra_low_memory" if gib else "balanced",
                        headroom=0.0)
    work = replace(workload_for(full), steps=1, guidance=False)
    placement = replace(plan.placement(component), prefetch=1)  # use_stream: the next group prefetched
    cost = component_cost(placement, full[component], 2, hardware.performance, work)
    copies = len([b for b in placement.blocks if b[0] not in set(placement.resident_blocks)])
    return cost.total + copies * latency


def rows() -> list[Row]:
    flux = "flux.1-dev"
    return [
        Row(CACHE_DIT, "L20", "resident (~38 GiB)", 23.4, pipeline_seconds(flux, "l20", 44, "balanced")),
        Row(CACHE_DIT, "L20", "diffusers sequential offload (~1 GiB)", 335,
            pipeline_seconds(flux, "l20", 1, "balanced_ultra_low_memory", DIFFUSERS_SEQUENTIAL)),
        Row(CACHE_DIT, "L20", "diffusers model offload (~25 GiB)", 56,
            model_offload_seconds(flux, "l20", DIFFUSERS_MODEL_OFFLOAD)),
        Row(CACHE_DIT, "L20", "layerwise, synchronous copies (~1 GiB)", 49,
            pipeline_seconds(flux, "l20", 1, "balanced_ultra_low_memory", SYNC_PINNED)),
        Row(CACHE_DIT, "L20", "layerwise, async, 1 bucket ahead (~4 GiB)", 41,
            pipeline_seconds(flux, "l20", 4, "balanced_ultra_low_memory", ahead=1)),
        Row(CACHE_DIT, "L20", "layerwise, async + 4 persistent (~8 GiB)", 33,
            pipeline_seconds(flux, "l20", 8, "balanced_ultra_low_memory", ahead=1)),
        Row(CACHE_DIT, "L20", "layerwise, async + 8 persistent (~14 GiB)", 26,
            pipeline_seconds(flux, "l20", 14, "balanced_ultra_low_memory")),
        Row(CACHE_DIT, "L20", "layerwise, async + 32 persistent (~16 GiB)", 24.6,
            pipeline_seconds(flux, "l20", 16, "balanced_ultra_low_memory")),
        Row(DIFFUSERS, "L40S", "FLUX.1-dev transformer, one forward 1024x1024, resident", 0.493,
            one_call_seconds(flux, "transformer", "l40s")),
        Row(DIFFUSERS, "L40S", "FLUX.1-dev transformer, one forward, group offload leaf_level + stream (0.56 GB)",
            1.859, one_call_seconds(flux, "transformer", "l40s", 0.56 * 1e9 / 2**30, GROUP_OFFLOAD_LEAF_LATENCY)),
        Row(DIFFUSERS, "L40S", "SDXL UNet, one forward 1024x1024, resident", 0.074,
            one_call_seconds("stable-diffusion-xl-base-1.0", "unet", "l40s")),
        Row(XDIT, "H100", "FLUX.1-dev pipeline, resident", 6.71, pipeline_seconds(flux, "h100", 79, "balanced")),
    ]


def table(found: list[Row]) -> str:
    lines = ["| GPU | setup | published s | predicted s | predicted/published | source |",
             "|---|---|---:|---:|---:|---|"]
    for row in found:
        flag = "" if 0.67 <= row.ratio <= 1.5 else " (outside 0.67-1.5)"
        lines.append(f"| {row.gpu} | {row.setup} | {row.published:g} | {row.predicted:.3g} | {row.ratio:.2f}{flag} "
                     f"| {row.source} |")
    return "\n".join(lines)


def main() -> None:
    found = rows()
    inside = sum(0.67 <= r.ratio <= 1.5 for r in found)
    text = "\n".join([
        "# Cost model calibration",
        "",
        "Generated by `python bench/calibration.py`: the cost model's predicted seconds beside published "
        "measurements of the same setup. Each setup is planned by pipemap's planner at the memory the source "
        "reports and priced with the source's copy mechanism (pageable or pinned, overlapped or not). Workload: "
        f"each pipeline's default call ({Workload(1024, 1024, 28, False).describe()} for FLUX.1-dev).",
        "",
        "Fitted, not predicted: the per-GPU FLOP/s (`hardware.GPU_PERFORMANCE`) of the L20 and L40S come from their "
        "resident rows (the cost model counts 2 FLOPs per parameter per token, which overcounts Flux's text stream, "
        "so they exceed datasheet peaks), the pageable bandwidth share (`cost.PAGEABLE_SHARE`) from the diffusers "
        "sequential-offload row, the group-offload per-leaf latency from its row, and the overlap by prefetch depth "
        "(`cost.STREAM_OVERLAP`) from the cache-dit async rows. The model-offload, synchronous-layerwise, SDXL and "
        "H100 rows then test it with nothing fitted to them. Prefetch depth is the source's (1 bucket ahead) where "
        "it fixed one; budgets are the memory the source reports.",
        "",
        table(found),
        "",
        f"{inside} of {len(found)} rows within 0.67x-1.5x.",
        "",
    ])
    Path(__file__).with_name("CALIBRATION.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
