"""A cost model: predicted seconds per image for a plan, so ``"auto"`` can take the fastest plan that fits.

Crude on purpose and explained by its parts: compute from parameter counts and the tokens each call processes (plus
self-attention, quadratic in the tokens, for transformers), host-to-GPU traffic for offloaded and streamed
components, GPU-to-GPU traffic where a component is split. The workload is the pipeline's own default call (steps,
true classifier-free guidance or guidance-distilled, resolution, frames: ``PIPELINE_DEFAULTS``) unless a call says
otherwise. The figures it uses live in ``Hardware.performance`` (FLOP/s, link bandwidths), overridable in the
hardware spec; ``bench/calibration.py`` holds its predictions against published measurements.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .devices import is_accelerator
from .granularity import LOOSE
from .hardware import Performance
from .inventory import PER_STEP, Component, Inventory
from .plan import Placement, Plan

# of the shorter of a streamed call's compute and copies, the part the other hides, by pieces fetched ahead: copies
# on a side stream still contend with the kernels for memory bandwidth, and a piece that computes faster than the
# next one copies leaves the GPU waiting unless more are already on their way. From cache-dit's L20 figures
# (bench/CALIBRATION.md): ~0.35 hidden with one piece ahead, most of it with four and a large resident share.
STREAM_OVERLAP = {0: 0.0, 1: 0.35, 2: 0.55, 3: 0.75}
COPY_LATENCY = 10e-6  # seconds per copy beyond its bytes: the launch, the event, the hook around the block
# host-to-GPU bandwidth from pageable memory (``module.to`` without pinning: accelerate's and diffusers' offloads), as
# a share of the pinned figure: staged through a driver buffer, ~2 GB/s on PCIe 4 (bench/CALIBRATION.md)
PAGEABLE_SHARE = 0.085
ACTIVATION_BYTES = 6144  # per token crossing GPUs: a 3072-wide hidden state in 16 bits
# A denoiser copy's share of a call crosses GPUs as latents (in and out: 4 latent pixels per token, 16 channels, 16
# bits) and the prompt's embeddings (512 tokens of 4096 in 16 bits); a call under guidance carries both halves,
# each of which DENOISER_CALLS counts as a call.
REPLICA_BYTES_PER_TOKEN = 2 * 4 * 16 * 2
PROMPT_BYTES = 512 * 4096 * 2
GUIDANCE_BATCH = 2


@dataclass(frozen=True)
class Workload:
    """What one image asks of the pipeline: its size, frames, denoising steps and whether each step calls the
    denoiser twice (true classifier-free guidance) or once (guidance-distilled, or guidance off)."""

    height: int = 1024
    width: int = 1024
    steps: int = 50
    guidance: bool = True
    frames: int = 1
    text_tokens: int = 0  # tokens a joint-attention transformer attends over beside the image's (Flux: 512)

    @property
    def calls(self) -> int:
        """Denoiser calls per image."""
        return self.steps * (2 if self.guidance else 1)

    @property
    def latent_tokens(self) -> int:
        # an 8x VAE, then 2x2 patches (transformers) or the first down-sampling stages (UNets); video: 4x in time
        frames = 1 if self.frames <= 1 else (self.frames - 1) // 4 + 1
        return max(1, frames * (self.height // 16) * (self.width // 16))

    @property
    def pixels(self) -> int:
        return self.height * self.width * max(1, self.frames)

    def describe(self) -> str:
        cfg = "true CFG, 2 calls a step" if self.guidance else "guidance-distilled, 1 call a step"
        frames = f"x{self.frames} frames" if self.frames > 1 else ""
        return f"{self.width}x{self.height}{frames}, {self.steps} steps, {cfg}"


# each pipeline's default call, as its diffusers __call__ (and model card) has it
PIPELINE_DEFAULTS: dict[str, Workload] = {
    "StableDiffusionPipeline": Workload(512, 512, 50, True),
    "StableDiffusionControlNetPipeline": Workload(512, 512, 50, True),
    "StableDiffusionXLPipeline": Workload(1024, 1024, 50, True),
    "StableDiffusion3Pipeline": Workload(1024, 1024, 28, True, text_tokens=333),  # 77 CLIP + 256 T5 tokens
    "FluxPipeline": Workload(1024, 1024, 28, False, text_tokens=512),  # guidance-distilled: guidance is an input
    # true CFG with the model card's negative prompt and true_cfg_scale=4.0
    "QwenImagePipeline": Workload(1024, 1024, 50, True, text_tokens=128),
    "WanPipeline": Workload(480, 832, 50, True, frames=81),
}


def workload_for(inventory: Inventory, call: Mapping | None = None) -> Workload:
    """The pipeline's default call (``PIPELINE_DEFAULTS``, else 1024x1024, 50 steps, true CFG), with what ``call``
    sets: ``num_inference_steps``, ``height``, ``width``, ``num_frames``, ``guidance_scale`` (<= 1 turns true CFG
    off), ``true_cfg_scale`` with a ``negative_prompt`` (turns it on).

    >>> workload_for(pipemap.inspect("flux.1-dev"), {"num_inference_steps": 50}).calls   # doctest: +SKIP
    50
    """
    work = PIPELINE_DEFAULTS.get(inventory.pipeline_class, Workload())
    call = dict(call or {})
    fields = {"steps": call.get("num_inference_steps"), "height": call.get("height"), "width": call.get("width"),
              "frames": call.get("num_frames")}
    work = replace(work, **{k: int(v) for k, v in fields.items() if v is not None})
    if work.guidance and call.get("guidance_scale") is not None and float(call["guidance_scale"]) <= 1.0:
        work = replace(work, guidance=False)
    if call.get("true_cfg_scale") is not None and call.get("negative_prompt") is not None:
        work = replace(work, guidance=float(call["true_cfg_scale"]) > 1.0)
    return work


@dataclass(frozen=True)
class Mechanism:
    """How moved weights travel: from pinned memory (else pageable), overlapped with compute on a side stream
    (else the GPU waits for each copy), and whether an offloaded model is copied back to the CPU after its use.
    pipemap's own hooks pin, overlap and never copy back; ``bench/calibration.py`` prices other tools' too."""

    pinned: bool = True
    overlap: bool = True
    copy_back: bool = False


PIPEMAP = Mechanism()


@dataclass(frozen=True)
class Cost:
    """One component's share of an image's time, in seconds."""

    component: str
    compute: float
    transfer: float
    total: float


def tokens_per_call(component: Component, work: Workload) -> int:
    """How many positions one call of the component processes (what its FLOPs scale with)."""
    name, cls = component.name, (component.class_name or "").lower()
    if name in PER_STEP:
        return work.latent_tokens + work.text_tokens
    if name.startswith("vae") or "autoencoder" in cls:
        return work.pixels // 16  # the decoder's convolutions run at up to full resolution
    if "t5" in cls or "umt5" in cls:
        return 512
    if "qwen" in cls or "llama" in cls or "gemma" in cls:
        return 1024
    return 77


def flops_per_call(component: Component, dtype_bytes: int, work: Workload) -> float:
    """2 FLOPs per parameter per token, and for a transformer's self-attention 4 per token pair per unit of width
    (scores and their weighted sum)."""
    tokens = tokens_per_call(component, work)
    flops = 2.0 * component.bytes / dtype_bytes * tokens
    if "transformer" in (component.class_name or "").lower() and component.name in PER_STEP:
        flops += 4.0 * tokens * tokens * component.attention_width
    return flops


def calls_per_image(component: Component, work: Workload) -> int:
    """A denoiser (or ControlNet) at every call of the workload; anything else once."""
    return work.calls if component.name in PER_STEP else 1


def component_cost(placement: Placement, component: Component, dtype_bytes: int, perf: Performance,
                   work: Workload, mechanism: Mechanism = PIPEMAP) -> Cost:
    """Seconds one image spends in a component as placed: its compute, plus the moves its mode implies
    (``moved_per_image`` bytes, over the host link or between GPUs)."""
    rate = perf.flops if is_accelerator(placement.execution_device) else perf.cpu_flops
    calls = calls_per_image(component, work)
    compute = calls * flops_per_call(component, dtype_bytes, work) / rate
    bandwidth = perf.host_bandwidth * (1.0 if mechanism.pinned else PAGEABLE_SHARE)
    moved = moved_per_image(placement, component, work)
    if placement.mode == "offload":  # one onload per image: the LRU keeps it while the others' calls run
        transfer = moved / bandwidth * (2 if mechanism.copy_back else 1)
        return Cost(component.name, compute, transfer, compute + transfer)
    if placement.mode == "stream":
        return Cost(component.name, compute, *_stream_seconds(placement, component, compute, calls, bandwidth,
                                                              mechanism))
    if placement.mode == "replicated":  # each call's parts run at once on the copies
        parts = min(GUIDANCE_BATCH, 1 + len(placement.replicas))
        transfer = moved / perf.peer_bandwidth
        return Cost(component.name, compute / parts, transfer, compute / parts + transfer)
    transfer = moved / perf.peer_bandwidth  # split: activations to each run of shards and back; resident: none
    return Cost(component.name, compute, transfer, compute + transfer)


def moved_per_image(placement: Placement, component: Component, work: Workload) -> float:
    """Bytes one image moves for a component as placed: an offloaded one once (the LRU keeps it while the others
    run), a streamed one its non-resident pieces at each call, a split one its activations to each run of shards
    and back at each call, a replicated one the batch parts sent to its copies (latents and prompt, there and
    back); a resident one nothing."""
    calls = calls_per_image(component, work)
    if placement.mode == "offload":
        return component.bytes
    if placement.mode == "stream":
        return calls * _moved_per_call(placement, component)[0]
    if placement.mode == "split":
        return calls * 2 * split_hops(placement) * work.latent_tokens * ACTIVATION_BYTES
    if placement.mode == "replicated":
        parts = min(GUIDANCE_BATCH, 1 + len(placement.replicas))
        return calls / GUIDANCE_BATCH * (parts - 1) * (work.latent_tokens * REPLICA_BYTES_PER_TOKEN + PROMPT_BYTES)
    return 0


def _stream_seconds(placement: Placement, component: Component, compute: float, calls: int, bandwidth: float,
                    mechanism: Mechanism) -> tuple[float, float]:
    """(transfer, total) of a streamed component: at each call its non-resident pieces cross the host link, each
    copy costing ``COPY_LATENCY`` more; the copies hide behind compute as far as the prefetch depth allows; the first
    piece of each call waits for its copy."""
    moved, copies, first = _moved_per_call(placement, component)
    transfer = calls * moved / bandwidth
    overlap = STREAM_OVERLAP[min(placement.prefetch or 1, 3)] if mechanism.overlap else 0.0
    hidden = overlap * min(compute, transfer)
    total = compute + transfer - hidden + calls * (copies * COPY_LATENCY + (first / bandwidth if overlap else 0))
    return transfer, total


def _moved_per_call(placement: Placement, component: Component) -> tuple[int, int, int]:
    """Bytes, copies and the largest piece moved at each call of a streamed component."""
    if not placement.blocks:  # a plan without pieces: its top-level blocks, every one at every call
        count = max(1, len(component.blocks))
        return component.bytes, count, component.bytes // count
    kept = set(placement.resident_blocks)
    streamed = [size for path, size in placement.blocks if path not in kept]
    loose = 0 if LOOSE in kept else max(0, component.bytes - sum(size for _, size in placement.blocks))
    return sum(streamed) + loose, len(streamed) + (1 if loose else 0), max(streamed, default=loose)


def predict(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None,
            mechanism: Mechanism = PIPEMAP) -> dict[str, Cost]:
    """Each planned component's predicted seconds per image; ``sum(c.total for c in ...)`` is the image's.
    Without ``work``, the pipeline's own default call (``workload_for``)."""
    work = work or workload_for(inventory)
    dtype_bytes = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(plan.dtype or "", 4)
    by_name = {c.name: c for c in inventory.models}
    cached = page_cached(plan)
    return {p.component: _with_disk(component_cost(p, by_name[p.component], dtype_bytes, perf, work, mechanism),
                                    disk_seconds(p, by_name[p.component], perf, work, cached))
            for p in plan.components if p.component in by_name}


# A read from the disk tier whose pages the page cache still holds runs at the speed of a memory copy through the
# map (minor faults and a copy into the staging buffer, one core): ~10 GB/s on a desktop core; on the 2-core VM of
# bench/RESULTS.md, 2.4 GB/s against 2.2 GB/s for a plain copy, the same.
PAGE_CACHE_BANDWIDTH = 10e9


def page_cached(plan: Plan) -> bool:
    """Whether the plan leaves the CPU free RAM enough for the page cache to keep every file it reads from."""
    cpu = next((d for d in plan.devices if d.device == "cpu"), None)
    disk = sum(p.disk_bytes for p in plan.components)
    return cpu is not None and disk > 0 and cpu.budget - cpu.used >= disk


def disk_seconds(placement: Placement, component: Component, perf: Performance, work: Workload,
                 cached: bool = False) -> float:
    """Seconds one image spends reading a component's disk tier (``Placement.disk_bytes``): an offloaded one once, a
    streamed one its pieces on disk at each call, at ``disk_bw``, or at ``PAGE_CACHE_BANDWIDTH`` when the page cache
    keeps them (``cached``). The host reads them before their copy to the GPU, so no compute hides them."""
    if not placement.disk_bytes or not is_accelerator(placement.execution_device):
        return 0.0  # computed on the CPU from the map: the kernel pages it in once
    reads = calls_per_image(component, work) if placement.mode == "stream" else 1
    return reads * placement.disk_bytes / (PAGE_CACHE_BANDWIDTH if cached else perf.disk_bandwidth)


def _with_disk(cost: Cost, disk: float) -> Cost:
    return replace(cost, transfer=cost.transfer + disk, total=cost.total + disk) if disk else cost


def split_hops(placement: Placement) -> int:
    """How many times a split component's activations leave home and come back at each call: once per run of
    consecutive shards on one GPU (``dispatch`` passes activations from block to block there directly)."""
    devices = [device for _, device, _ in placement.shards]
    return sum(1 for i, device in enumerate(devices) if i == 0 or devices[i - 1] != device)


def bytes_moved(plan: Plan, inventory: Inventory, work: Workload | None = None) -> dict[str, int]:
    """Bytes each planned component moves per image (``moved_per_image``), at the pipeline's default call unless
    ``work`` is given."""
    work = work or workload_for(inventory)
    by_name = {c.name: c for c in inventory.models}
    return {p.component: round(moved_per_image(p, by_name[p.component], work))
            for p in plan.components if p.component in by_name}


def seconds_per_image(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None,
                      mechanism: Mechanism = PIPEMAP) -> float:
    """The predicted seconds per image of a plan (the pipeline's default call unless ``work`` is given)."""
    return sum(c.total for c in predict(plan, inventory, perf, work, mechanism).values())


def device_seconds(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None
                   ) -> dict[str, float]:
    """Each device's busy seconds per image: a component's time on the device it computes on, a split
    component's compute shared by its GPUs in proportion to their bytes, a replicated one's on each copy's device."""
    busy: collections.Counter = collections.Counter()
    placements = {p.component: p for p in plan.components}
    for name, cost in predict(plan, inventory, perf, work).items():
        p = placements[name]
        if p.mode == "replicated":
            for device in (p.execution_device, *p.replicas):
                busy[device] += cost.total
        elif p.mode == "split" and p.bytes:
            away = sum(size for _, _, size in p.shards)
            busy[p.execution_device] += cost.compute * (p.bytes - away) / p.bytes + cost.transfer
            for _, device, size in p.shards:
                busy[device] += cost.compute * size / p.bytes
        else:
            busy[p.execution_device] += cost.total
    return dict(busy)


def images_per_second(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None
                      ) -> float | None:
    """The predicted images per second with requests overlapped (``pipemap.run_many``): each device works on one
    request at a time, so the busiest device's seconds per image set the pace. None for an empty plan."""
    slowest = max(device_seconds(plan, inventory, perf, work).values(), default=0.0)
    return 1.0 / slowest if slowest > 0 else None
