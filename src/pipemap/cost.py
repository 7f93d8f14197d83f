"""A cost model: predicted seconds per image for a plan, so ``"auto"`` can take the fastest plan that fits.

Crude on purpose and explained by its parts: compute from parameter counts and the tokens each call processes,
host-to-GPU traffic for offloaded and streamed components, GPU-to-GPU traffic where a component is split. The
figures it uses live in ``Hardware.performance`` (FLOP/s, link bandwidths), overridable in the hardware spec.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .hardware import Performance, is_accelerator
from .inventory import PER_STEP, Component, Inventory
from .plan import Placement, Plan

# of the shorter of a streamed call's compute and copies, the part the other hides: copies on a side stream still
# contend with the kernels for memory bandwidth, and the first block of each call waits
STREAM_OVERLAP = 0.75
ACTIVATION_BYTES = 6144  # per token crossing GPUs: a 3072-wide hidden state in 16 bits
# A denoiser copy's share of a call crosses GPUs as latents (in and out: 4 latent pixels per token, 16 channels, 16
# bits) and the prompt's embeddings (512 tokens of 4096 in 16 bits); a call under guidance carries both halves,
# each of which DENOISER_CALLS counts as a call.
REPLICA_BYTES_PER_TOKEN = 2 * 4 * 16 * 2
PROMPT_BYTES = 512 * 4096 * 2
GUIDANCE_BATCH = 2


@dataclass(frozen=True)
class Workload:
    """What one image asks of the pipeline: its size, and the tokens its text encoders read."""

    height: int = 1024
    width: int = 1024

    @property
    def latent_tokens(self) -> int:
        # an 8x VAE, then 2x2 patches (transformers) or the first down-sampling stages (UNets)
        return max(1, (self.height // 16) * (self.width // 16))

    @property
    def pixels(self) -> int:
        return self.height * self.width


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
        return work.latent_tokens
    if name.startswith("vae") or "autoencoder" in cls:
        return work.pixels // 16  # the decoder's convolutions run at up to full resolution
    if "t5" in cls or "umt5" in cls:
        return 512
    if "qwen" in cls or "llama" in cls or "gemma" in cls:
        return 1024
    return 77


def component_cost(placement: Placement, component: Component, dtype_bytes: int, perf: Performance,
                   work: Workload) -> Cost:
    """Seconds one image spends in a component as placed: its compute, plus the moves its mode implies."""
    params = component.bytes / dtype_bytes
    flops = 2.0 * params * tokens_per_call(component, work)
    rate = perf.flops if is_accelerator(placement.execution_device) else perf.cpu_flops
    calls = max(1, component.calls_per_image)
    compute = calls * flops / rate
    transfer, total = 0.0, compute
    if placement.mode == "offload":  # one onload per image: the LRU keeps it while the others' calls run
        transfer = component.bytes / perf.host_bandwidth
        total = compute + transfer
    elif placement.mode == "stream":  # every call streams every block, mostly overlapped with compute
        transfer = calls * component.bytes / perf.host_bandwidth
        hidden = STREAM_OVERLAP * min(compute, transfer)
        total = compute + transfer - hidden + component.bytes / perf.host_bandwidth / max(1, _blocks(component))
    elif placement.mode == "split":  # each block away from home: its activations go there and back at every call
        transfer = calls * 2 * len(placement.shards) * work.latent_tokens * ACTIVATION_BYTES / perf.peer_bandwidth
        total = compute + transfer
    elif placement.mode == "replicated":
        return replicated_cost(placement, compute, calls, perf, work)
    return Cost(component.name, compute, transfer, total)


def replicated_cost(placement: Placement, compute: float, calls: int, perf: Performance, work: Workload) -> Cost:
    """A denoiser with copies: the parts of each batched call (both guidance halves) run at once, so its compute
    divides by the copies that get a part; each part away from home sends its latents and prompt there and back."""
    parts = min(GUIDANCE_BATCH, 1 + len(placement.replicas))
    per_call = (parts - 1) * (work.latent_tokens * REPLICA_BYTES_PER_TOKEN + PROMPT_BYTES)
    transfer = calls / GUIDANCE_BATCH * per_call / perf.peer_bandwidth
    return Cost(placement.component, compute / parts, transfer, compute / parts + transfer)


def _blocks(component: Component) -> int:
    return max(1, len(component.blocks))


def predict(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None) -> dict[str, Cost]:
    """Each planned component's predicted seconds per image; ``sum(c.total for c in ...)`` is the image's."""
    work = work or Workload()
    dtype_bytes = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(plan.dtype or "", 4)
    by_name = {c.name: c for c in inventory.models}
    return {p.component: component_cost(p, by_name[p.component], dtype_bytes, perf, work)
            for p in plan.components if p.component in by_name}


def seconds_per_image(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None) -> float:
    """The predicted seconds per image of a plan."""
    return sum(c.total for c in predict(plan, inventory, perf, work).values())


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
