"""The cost model: predicted seconds per image for a plan, so ``"auto"`` can take the fastest plan that fits and
``pipemap.estimate`` can say what a call will take.

Work is counted, not guessed: a dry run runs each component's real forward at the call's shapes and counts its
FLOPs, the bytes its memory-bound kernels move and the kernels it launches (``counts.Counts``, from
``dryrun.counter``); a folder whose counts are not known yet is priced by a formula on its parameter counts
(``formula_counts``), and the plan says which priced it. Compute is FLOPs over sustained FLOP/s, plus memory-bound
bytes over sustained memory bandwidth, plus each kernel launch's overhead (``compute_seconds``); copies are bytes
over the link plus a latency a copy (``copy_seconds``); a streamed component's copies overlap its compute as its
hook's streams do: a copy queue ahead of the compute queue by ``prefetch`` pieces, through ``prefetch + 1`` buffers,
each copy asked for when the host reaches the piece ``prefetch`` before it (``stream_call_seconds``); a tool whose
host waits at each piece (diffusers' group offload) hides a copy behind one piece only (``waiting_call_seconds``).
The figures live in ``Hardware.performance``; ``bench/calibration.py`` fits the two
constants on few published measurements and holds the model against others it was never fitted on.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .counts import PIPELINE, ComponentCounts, Counts, Tally
from .devices import is_accelerator
from .experts import EXPERTS, expert_steps
from .granularity import LOOSE, Block
from .hardware import Performance
from .inventory.values import PER_STEP, Component, Inventory
from .modes import Mode, Peak, branch_devices, facts
from .plan import Placement, Plan

COPY_LATENCY = 10e-6  # seconds per copy beyond its bytes: the launch, the event, the hook around the block
# host-to-GPU bandwidth from pageable memory (``module.to`` without pinning: accelerate's and diffusers' offloads), as
# a share of the pinned figure: staged through a driver buffer. Fitted on diffusers' sequential offload of FLUX.1-dev
# on an L20 (bench/CALIBRATION.md).
PAGEABLE_SHARE = 0.0869
FP32_RATE = 0.5  # float32 operands run on TF32 tensor cores: half the bf16 rate on every GPU of GPU_PERFORMANCE
# PyTorch's math attention in 16 bits, per score element: the scores written by Q K^T (2 bytes), read and written by
# the softmax (4), read by the product with V (2); a fused kernel keeps them on chip
MATH_SCORE_BYTES = 8
ACTIVATION_BYTES = 6144  # per token crossing GPUs: a 3072-wide hidden state in 16 bits
# A denoiser copy's share of a call crosses GPUs as latents (in and out: 4 latent pixels per token, 16 channels, 16
# bits) and the prompt's embeddings (512 tokens of 4096 in 16 bits); a call under guidance carries both halves,
# each of which DENOISER_CALLS counts as a call.
REPLICA_BYTES_PER_TOKEN = 2 * 4 * 16 * 2
PROMPT_BYTES = 512 * 4096 * 2
GUIDANCE_BATCH = 2
# The formula's stand-ins for what only a count knows, the medians over the catalog's recorded counts
# (``catalog/counts.record``; bench/calibration.py derives them): bytes the memory-bound kernels of a denoiser move
# per FLOP outside attention (a fused attention kernel moves none through them: per FLOP of all kinds, a long video
# sequence's attention, 53% of Wan's FLOPs at 480p and 80% at 720p, priced memory traffic that never happens), and
# kernels a call per module with weights, a denoiser's and another component's.
MEMORY_BYTES_PER_FLOP = 0.0025
KERNELS_PER_MODULE = 4.7
KERNELS_PER_MODULE_ONCE = 1.8
# Guidance branches at once: each call that arrives is checked against the one started ahead (identity, version
# counters, a small tensor compared at most): a few Python operations per input, and a thread hand-over
VERIFY_SECONDS = 100e-6
# A sequence split: every attention layer exchanges queries, keys, values and its output (Ulysses all-to-all) in 16
# bits, each exchange one collective between the GPUs' ranks (NCCL between worker processes, ``hooks/workers.py``;
# threads meeting in one process, ``hooks/exchange.py``): NCCL's small-message all-to-all latency over NVLink is
# 20-30 us (nccl-tests' alltoall_perf), the rank's launch and wait around it as much again. Not fitted.
EXCHANGED_TENSORS = 4
EXCHANGE_ITEM_BYTES = 2
EXCHANGE_LATENCY = 50e-6
# An all-to-all among more ranks is one send and receive pair more per rank (NCCL's alltoall is grouped
# point-to-point calls): its latency grows with them, as nccl-tests' alltoall_perf small-message times do from 2 to 8
# GPUs (approximate, not fitted). The same for a call's broadcast and gather.
RANK_LATENCY = 10e-6
# Each collective waits for the slowest rank, and an all-to-all among more ranks waits on more peers (NCCL's
# alltoall is grouped send and receive pairs, one a peer), each of which may have drifted behind since the last one
# (launch timing, clocks, its proxy thread's turn): a wait per collective and rank beyond two (two ranks are what the
# Hopper host's launch is fitted on), not a share of the work between two collectives, so a long video sequence's
# layers (Wan 2.1 at 1280x720x81 over 8 H100s: 15 ms of work an exchange) hardly notice it and Qwen-Image at
# 2048x2048 over 8 H800s (1.3 ms) does. It waits on the GPU's side: a launch-bound rank's host sets the pace and
# hides it (xDiT's eager FLUX.1-dev gains a little from 2 to 4 H100s). Fitted on vLLM-Omni's Qwen-Image at 2048x2048
# over 8 H800s (bench/CALIBRATION.md); it replaced a share of a rank's work per rank beyond two, fitted on the same
# row, which priced Wan 2.1's 8-GPU runs (the Wan 2.1 README's table) at 1.45x the published times.
STRAGGLER_WAIT = 71e-6
# Around each all-to-all, Ulysses attention permutes its tensors into the layout the exchange sends and back (a
# contiguous copy each way): 38% of the exchange's time on an H100 (pytorch/pytorch#178066), priced as that share of
# the exchange's time on top of its bytes over the link
PERMUTE_SHARE = 0.38
# and at each call its inputs are broadcast to the other ranks and its output gathered back: two collectives more
SEQUENCE_CALL_COLLECTIVES = 2
# Each exchange is host work on every rank as well: the copy into the layout the all-to-all sends, the collective,
# the copy back (diffusers' ``TemplatedUlyssesAttention``: ``permute().contiguous()``, ``all_to_all_single``,
# ``permute().contiguous()``), three launches at the host's price a kernel, on top of the plain call's kernels that
# every rank launches: what a split adds to a launch-bound rank's time
EXCHANGE_LAUNCHES = 3
# Ranks run as threads of one process (``Plan.ranks == "thread"``) launch through one interpreter lock, so their
# host work adds up rank by rank, and each exchange is two meetings at a ``threading.Barrier`` instead of one NCCL
# collective: 202 us the pair, measured on the 2-core VM of bench/repros/workers/REVIEW.md (section 6)
THREAD_EXCHANGE_SECONDS = 202e-6
# A batch cut across copies meets once a call: the parts gathered (an all-gather of the outputs) and the inputs
# broadcast, each a small collective: NCCL's small-message latency over NVLink is 10-30 us (nccl-tests), the host's
# hand-over around it as much again
COLLECTIVE_LATENCY = 50e-6


@dataclass(frozen=True)
class Workload:
    """What one call asks of the pipeline: its size, frames, denoising steps, images per prompt and whether each
    step calls the denoiser twice (true classifier-free guidance) or once (guidance-distilled, or guidance off).
    What the formula prices when no count is known, and what a plan's description says."""

    height: int = 1024
    width: int = 1024
    steps: int = 50
    guidance: bool = True
    frames: int = 1
    text_tokens: int = 0  # tokens a joint-attention transformer attends over beside the image's (Flux: 512)
    images: int = 1
    # the pixels a side of one latent token covers (the VAE's scale times the denoiser's patch: an 8x VAE and 2x2
    # patches, 16; LTX-Video's and SANA's 32x autoencoders with 1x1 patches, 32) and the frames one covers in time
    token_pixels: int = 16
    token_frames: int = 4

    @property
    def calls(self) -> int:
        """Denoiser calls per image (batch-1 equivalents)."""
        return self.steps * (2 if self.guidance else 1)

    @property
    def latent_tokens(self) -> int:
        # by default an 8x VAE, then 2x2 patches (transformers) or the first down-sampling stages (UNets); video: 4x
        # in time (``token_pixels``, ``token_frames``)
        frames = 1 if self.frames <= 1 else (self.frames - 1) // self.token_frames + 1
        return max(1, frames * (self.height // self.token_pixels) * (self.width // self.token_pixels))

    @property
    def pixels(self) -> int:
        return self.height * self.width * max(1, self.frames)

    def describe(self) -> str:
        cfg = "true CFG, 2 calls a step" if self.guidance else "1 call a step"
        frames = f"x{self.frames} frames" if self.frames > 1 else ""
        images = f", {self.images} images" if self.images > 1 else ""
        return f"{self.width}x{self.height}{frames}, {self.steps} steps, {cfg}{images}"


# each pipeline's default call, as its diffusers __call__ has it
PIPELINE_DEFAULTS: dict[str, Workload] = {
    "StableDiffusionPipeline": Workload(512, 512, 50, True),
    "StableDiffusionControlNetPipeline": Workload(512, 512, 50, True),
    "StableDiffusionXLPipeline": Workload(1024, 1024, 50, True),
    "StableDiffusion3Pipeline": Workload(1024, 1024, 28, True, text_tokens=333),  # 77 CLIP + 256 T5 tokens
    "FluxPipeline": Workload(1024, 1024, 28, False, text_tokens=512),  # guidance-distilled: guidance is an input
    # true CFG only with a negative prompt (true_cfg_scale > 1 and negative_prompt given): without one, 1 call a step
    "QwenImagePipeline": Workload(1024, 1024, 50, False, text_tokens=128),
    "WanPipeline": Workload(480, 832, 50, True, frames=81),
    # guidance embedded in the transformer's input: true CFG only with a negative prompt and true_cfg_scale > 1;
    # its LLaVA-Llama prompt cut to 256 tokens, attended jointly with the video's
    "HunyuanVideoPipeline": Workload(720, 1280, 50, False, frames=129, text_tokens=256),
    # the catalog's other classes (issue 52), from their __call__'s defaults and their catalog entry's sample size
    "FluxKontextPipeline": Workload(1024, 1024, 28, False, text_tokens=512),  # guidance-distilled, as Flux
    "Flux2Pipeline": Workload(1024, 1024, 50, False, text_tokens=512),  # guidance-distilled: guidance is an input
    "QwenImageEditPipeline": Workload(1024, 1024, 50, False, text_tokens=128),  # true CFG with a negative prompt
    "QwenImageEditPlusPipeline": Workload(1024, 1024, 50, False, text_tokens=128),
    "HiDreamImagePipeline": Workload(1024, 1024, 50, True, text_tokens=256),  # 128 T5 + 128 Llama; CFG as a batch
    "LTXPipeline": Workload(512, 704, 50, True, frames=161, text_tokens=128, token_pixels=32, token_frames=8),
    "CogVideoXPipeline": Workload(480, 720, 50, True, frames=49, text_tokens=226),
    "SanaPipeline": Workload(1024, 1024, 20, True, text_tokens=300, token_pixels=32),  # DC-AE 32x, 1x1 patches
    "PixArtSigmaPipeline": Workload(1024, 1024, 20, True, text_tokens=300),
    "Lumina2Pipeline": Workload(1024, 1024, 30, True, text_tokens=256),
    "ChromaPipeline": Workload(1024, 1024, 35, True, text_tokens=512),
}


# pipelines whose true classifier-free guidance runs only with a negative prompt, and their default true_cfg_scale
TRUE_CFG = {"QwenImagePipeline": 4.0, "FluxPipeline": 1.0, "FluxKontextPipeline": 1.0, "QwenImageEditPipeline": 4.0,
            "QwenImageEditPlusPipeline": 4.0, "HunyuanVideoPipeline": 1.0}


def workload_for(inventory: Inventory, call: Mapping | None = None) -> Workload:
    """The pipeline's default call (``PIPELINE_DEFAULTS``, else 1024x1024, 50 steps, true CFG), with what ``call``
    sets: ``num_inference_steps``, ``height``, ``width``, ``num_frames``, ``num_images_per_prompt``,
    ``guidance_scale`` (<= 1 turns true CFG off), ``true_cfg_scale`` with a ``negative_prompt`` (turns it on).

    >>> workload_for(pipemap.inspect("flux.1-dev"), {"num_inference_steps": 50}).calls   # doctest: +SKIP
    50
    """
    work = PIPELINE_DEFAULTS.get(inventory.pipeline_class, Workload())
    call = dict(call or {})
    fields = {"steps": call.get("num_inference_steps"), "height": call.get("height"), "width": call.get("width"),
              "frames": call.get("num_frames"), "images": call.get("num_images_per_prompt")}
    given: dict[str, Any] = {k: int(v) for k, v in fields.items() if v is not None}
    work = replace(work, **given)
    if work.guidance and call.get("guidance_scale") is not None and float(call["guidance_scale"]) <= 1.0:
        work = replace(work, guidance=False)
    if call.get("negative_prompt") is not None and inventory.pipeline_class in TRUE_CFG:
        scale = call.get("true_cfg_scale", TRUE_CFG[inventory.pipeline_class])
        work = replace(work, guidance=float(scale) > 1.0)
    return work


@dataclass(frozen=True)
class Mechanism:
    """How moved weights travel: from pinned memory (else pageable), overlapped with compute on a side stream
    (else the GPU waits for each copy), whether an offloaded model is copied back to the CPU after its use, and the
    seconds each copy adds beyond its bytes. pipemap's own hooks pin, overlap and never copy back;
    ``bench/calibration.py`` prices other tools' too."""

    pinned: bool = True
    overlap: bool = True
    copy_back: bool = False
    copy_latency: float = COPY_LATENCY
    # the host waits for each piece's copy and compute before it moves on (diffusers' group offload with streams:
    # ``stream.synchronize()`` before each prefetch, ``current_stream().synchronize()`` after each group's forward
    # unless record_stream), so the next copy overlaps only the current piece and the GPU idles ``wait_latency``
    # a piece while the host's hook runs (``waiting_call_seconds``)
    waits: bool = False
    wait_latency: float = 0.0


PIPEMAP = Mechanism()


@dataclass(frozen=True)
class Cost:
    """One component's share of an image's time, in seconds: its compute, its copies, the part of the copies its
    compute hides (``hidden``), and the total (compute + transfer - hidden, and latencies)."""

    component: str
    compute: float
    transfer: float
    total: float
    hidden: float = 0.0
    launch_bound: bool = False  # its GPU waits for the host's kernel launches: a faster GPU would not help


# ---- pricing work and copies ----------------------------------------------------------------------------------


def compute_seconds(work: Tally, perf: Performance, on_gpu: bool = True) -> float:
    """Seconds the kernels of ``work`` take: the GPU's time (FLOPs over the sustained FLOP/s, float32 operands at
    ``FP32_RATE`` of it, plus memory-bound bytes over the sustained memory bandwidth) or the host's time launching
    them (each kernel's Python and dispatch overhead), whichever is longer: eager PyTorch launches asynchronously,
    so a large model keeps the GPU busy while the host runs ahead, and a small one leaves it waiting for launches.
    On the CPU, its FLOP/s alone.

    >>> compute_seconds(Tally(flops=1e12, memory_bytes=1e9, kernels=1000), Performance(flops=100e12,
    ...                 memory_bandwidth=1e12, kernel_seconds=1e-5))
    0.011
    """
    if not on_gpu:
        return work.flops / perf.cpu_flops
    return max(gpu_seconds(work, perf), work.kernels * perf.kernel_seconds)


def shared_compute(work: Tally, perf: Performance, on_gpu: bool, gpus: int, ranks: str | None = None,
                   waits: float = 0.0) -> float:
    """Seconds each of ``gpus`` GPUs takes for its share of ``work`` when a call is cut across them (a batch's parts,
    a sequence's tokens): the GPU's time shares, the host's does not: each GPU's process launches every kernel of
    its share (a part of a batch or of the tokens runs the same kernels), so a launch-bound call gains little; ranks
    that are threads of one process (``ranks="thread"``) launch one after the other (``rank_launch_seconds``).
    ``waits``: the seconds each rank's GPU waits for the slowest at the collectives (``straggler_seconds``)."""
    if not on_gpu:
        return work.flops / perf.cpu_flops / gpus
    return max(gpu_seconds(work, perf) / gpus + waits, rank_launch_seconds(work.kernels, perf, gpus, ranks))


def rank_launch_seconds(kernels: float, perf: Performance, gpus: int, ranks: str | None = None) -> float:
    """The host's seconds launching ``kernels`` on each of ``gpus`` ranks: in parallel for worker processes (each its
    own interpreter: ``"process"``, ``"ray"``, or a plan without ranks), one rank after the other for threads of one
    process (one interpreter lock).

    >>> rank_launch_seconds(1000, Performance(flops=1e12, kernel_seconds=1e-5), 4, "thread")
    0.04
    """
    return kernels * perf.kernel_seconds * (gpus if ranks == "thread" else 1)


def launch_seconds(work: Tally, perf: Performance, on_gpu: bool = True) -> float:
    """The host's seconds launching the kernels of ``work`` on a GPU (none on the CPU: it computes as it goes)."""
    return work.kernels * perf.kernel_seconds if on_gpu else 0.0


def is_launch_bound(work: Tally, perf: Performance, ranks: int = 1) -> bool:
    """Whether the host's kernel launches (``perf.kernel_seconds`` each) take longer than the GPU's own work, that
    work shared by ``ranks`` GPUs (each launching every kernel of its share: a sequence split's ranks)."""
    return work.kernels > 0 and work.kernels * perf.kernel_seconds > gpu_seconds(work, perf) / ranks


def token_ranks(placement: Placement) -> int:
    """How many GPUs share each call's tokens: a sequence split's ranks, a branch's half of ``guidance_sequence``'s;
    1 otherwise (a batch split shares the batch, each part still launching every kernel)."""
    if placement.mode == Mode.SEQUENCE:
        return 1 + len(placement.replicas)
    if placement.mode == Mode.GUIDANCE_SEQUENCE:
        return 1 + len(_first_branch(placement).replicas)
    return 1


LAUNCH_NOTE_SHARE = 0.05  # a launch-bound component is named when it takes this share of the call or more


def launch_bound(costs: Mapping[str, Cost]) -> list[str]:
    """The components whose calls wait for the host's launches and take a noticeable share of the call."""
    total = sum(c.total for c in costs.values())
    return [name for name, c in costs.items() if c.launch_bound and c.compute > 0
            and c.compute >= LAUNCH_NOTE_SHARE * total]


def launch_note(costs: Mapping[str, Cost], perf: Performance) -> str | None:
    """A line naming the components whose calls wait for the host's launches (``launch_bound``), or None."""
    bound = launch_bound(costs)
    if not bound:
        return None
    return (f"launch-bound: {', '.join(bound)} wait for the host's kernel launches ({perf.kernel_text}): a faster "
            "host, CUDA graphs or torch.compile would speed them up, a faster GPU would not")


def gpu_seconds(work: Tally, perf: Performance) -> float:
    """The GPU's own time for ``work``, each work class at its rate: matrix products at the sustained FLOP/s
    (float32 operands at ``FP32_RATE`` of it), fused attention at its backend's (``perf.attention_flops``; the dense
    rate unless the profile names a fused backend), memory-bound bytes at the sustained memory bandwidth, and under
    the math backend the score matrices it materialises (``MATH_SCORE_BYTES`` an element) too."""
    half = work.flops - work.fp32_flops
    attention = min(work.attention_flops, half) if perf.attention_flops is not None else 0.0
    scores = work.attention_scores * MATH_SCORE_BYTES if perf.attention == "math" else 0.0
    return ((half - attention) / perf.flops + work.fp32_flops / (perf.flops * FP32_RATE)
            + (attention / perf.attention_flops if attention and perf.attention_flops else 0.0)
            + (work.memory_bytes + scores) / perf.memory_bandwidth)


def copy_seconds(size: float, bandwidth: float, copies: float = 1, latency: float = COPY_LATENCY) -> float:
    """Seconds ``copies`` copies of ``size`` bytes in all take over a link of ``bandwidth`` bytes per second."""
    return size / bandwidth + copies * latency


@dataclass(frozen=True)
class Piece:
    """One piece of a streamed call: its compute seconds and, if it crosses the host link, its copy's seconds."""

    compute: float
    copy: float | None = None  # None: resident on the GPU
    host: float = 0.0  # the host's seconds launching its kernels: when it reaches the next piece's hook


def stream_call_seconds(pieces: Sequence[Piece], root_copy: float = 0.0, depth: int = 1, own_buffers: bool = False,
                        overlap: bool = True) -> float:
    """Seconds one call of a streamed component takes, as ``hooks.stream.StreamHook`` runs it: the loose tensors
    copied first on the compute queue (``root_copy``), then the pieces in order; a streamed piece's copy runs on
    one copy queue ahead of the compute, at most ``depth`` pieces ahead, into one of ``depth + 1`` buffers, which it
    waits to be freed by the piece that used it last (unless every piece has its own buffer); a piece computes once
    its copy is in. Without ``overlap`` every copy waits for the compute before it (synchronous copies).

    >>> stream_call_seconds([Piece(1.0, 1.0), Piece(1.0, 1.0), Piece(1.0, 1.0)])    # copies hide behind compute
    4.0
    >>> stream_call_seconds([Piece(1.0, 1.0)] * 3, overlap=False)
    6.0
    """
    compute_free = link_free = root_copy
    freed: list[float] = []  # when each streamed piece's buffer was freed, in order
    issued = _issue_times(pieces, depth)
    for piece in pieces:
        if piece.copy is None:
            compute_free += piece.compute
            continue
        start = max(link_free, issued[len(freed)]) if overlap else max(link_free, compute_free)
        if not own_buffers and len(freed) > depth:
            start = max(start, freed[-depth - 1])
        link_free = start + piece.copy
        compute_free = max(compute_free, link_free) + piece.compute
        freed.append(compute_free)
    return compute_free


def _issue_times(pieces: Sequence[Piece], depth: int) -> list[float]:
    """When the host asks for each streamed piece's copy: the first ``depth`` at the call's start, each later one
    as the host enters the streamed piece ``depth`` before it (``StreamHook._prefetch``), having launched the
    kernels of every piece before that one. Never waiting on the GPU, the host runs ahead unless launching is what
    takes the time."""
    entered, host = [], 0.0
    for piece in pieces:
        if piece.copy is not None:
            entered.append(host)
        host += piece.host
    return [0.0 if i < depth else entered[i - depth] for i in range(len(entered))]


def waiting_call_seconds(pieces: Sequence[Piece], root_copy: float = 0.0, latency: float = 0.0) -> float:
    """Seconds one call takes when the host waits at every streamed piece (``Mechanism.waits``: diffusers' group
    offload with ``use_stream=True``): entering one it waits for its copy, starts the next one's copy, launches its
    kernels and waits for them, so a copy hides only behind the compute between its start and its piece (the work
    of the piece before it and of the modules without weights between them), and the GPU idles ``latency`` a piece
    while the hook runs. The first copy starts with the call, after the root's tensors (``root_copy``).

    >>> waiting_call_seconds([Piece(1.0, 1.0), Piece(1.0, 1.0), Piece(1.0, 1.0)], latency=0.5)
    5.5
    >>> waiting_call_seconds([Piece(1.0, 2.0), Piece(1.0, 2.0)])   # the link sets the pace
    5.0
    """
    copies = [p.copy for p in pieces if p.copy is not None]
    now = root_copy
    arrives = now + copies[0] if copies else now  # when the copy in flight is in
    done = 0
    for piece in pieces:
        if piece.copy is not None:
            # stream.synchronize(): this piece's copy is in; then the hook's Python issues the next copy, the link
            # and the GPU both idle meanwhile
            now = max(now, arrives) + latency
            done += 1
            arrives = now + copies[done] if done < len(copies) else now
        now += piece.compute  # launched, then waited for (current_stream().synchronize())
    return now


def call_seconds(pieces: Sequence[Piece], root_copy: float, depth: int, own_buffers: bool,
                 mechanism: Mechanism) -> float:
    """One call of a component moved piece by piece, as ``mechanism`` runs it: queues ahead of the host
    (``stream_call_seconds``: pipemap's hooks, cache-dit) or the host waiting at each piece
    (``waiting_call_seconds``: diffusers' group offload)."""
    if mechanism.waits:
        return waiting_call_seconds(pieces, root_copy, mechanism.wait_latency)
    return stream_call_seconds(pieces, root_copy, depth, own_buffers, mechanism.overlap)


# ---- the work of a component -------------------------------------------------------------------------------------


def tokens_per_call(component: Component, work: Workload) -> int:
    """How many positions one call of the component processes, for the formula: a denoiser its image's tokens, a
    VAE its pixels at the decoder's working resolution, a text encoder its sequence."""
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


# a denoiser's weights by what they act on, from diffusers' module names: the text stream of a joint transformer
# (Flux's ``*_context``, SD 3's ``add_*_proj``, Qwen-Image's ``txt_*``), and the modulation and timestep layers that
# act on one token a sample (``*norm*.linear``, ``*_mod``, ``time*``)
_TEXT = re.compile(r"(^|\.)(txt_|add_[qkv]_proj|to_add_out|context_embedder|ff_context|norm1_context|norm_added)")
_ONE_TOKEN = re.compile(r"(^|\.)(img_mod|txt_mod|time|norm\w*\.linear|norm_out|adaln)")


def flops_per_call(component: Component, dtype_bytes: int, work: Workload) -> float:
    """The formula: 2 FLOPs per parameter per token it acts on (a denoiser's text-stream weights on the text's
    tokens, its modulation layers on one, the rest on the image's), and for a transformer's self-attention 4 per
    token pair per unit of width (scores and their weighted sum) over image and text tokens."""
    tokens = tokens_per_call(component, work)
    if component.name not in PER_STEP or component.tree is None:
        return 2.0 * component.bytes / dtype_bytes * tokens
    if "unet" in (component.class_name or "").lower():
        return 2.0 / dtype_bytes * _unet_weight_positions(component.tree, work)
    text, one = _weights_by_use(component.tree)
    image = max(0, component.bytes - text - one)
    return 2.0 / dtype_bytes * (image * tokens + text * work.text_tokens + one) + attention_flops_per_call(component,
                                                                                                          work)


def attention_flops_per_call(component: Component, work: Workload) -> float:
    """The formula's self-attention FLOPs of one call of a transformer denoiser: 4 per token pair per unit of width
    (scores and their weighted sum) over image and text tokens; none for anything else (a UNet's attention is in
    its weights' share)."""
    if (component.name not in PER_STEP or component.tree is None
            or "transformer" not in (component.class_name or "").lower()):
        return 0.0
    attended = tokens_per_call(component, work) + work.text_tokens
    return 4.0 * attended * attended * component.attention_width


def _unet_weight_positions(tree: Block, work: Workload) -> float:
    """A UNet's bytes times the positions they act on: each down block at its resolution (the latent's halved at
    each block before it), the up blocks mirrored, the mid block at the lowest; time embeddings on one position."""
    latent = work.latent_tokens * 4  # the 8x VAE's latent pixels (latent_tokens assumes a further 2x2)
    tops = {child.path: child for child in tree.children}
    downs = len([p for p in tops.get("down_blocks", Block("", 0)).children])
    total = 0.0
    for path, block in tops.items():
        if path in ("down_blocks", "up_blocks"):
            for i, child in enumerate(block.children):
                level = i if path == "down_blocks" else downs - 1 - i
                total += child.bytes * latent / 4 ** max(0, level)
        elif path == "mid_block":
            total += block.bytes * latent / 4 ** max(0, downs - 1)
        elif not path.startswith(("time", "add_", "class_")):
            total += block.bytes * latent
        else:
            total += block.bytes
    return total


@functools.lru_cache(maxsize=32)
def _weights_by_use(tree: Block) -> tuple[int, int]:
    """Bytes of a denoiser's text-stream weights and of its one-token weights."""
    text = one = 0
    stack = [tree]
    while stack:
        block = stack.pop()
        if _ONE_TOKEN.search(block.path):
            one += block.bytes
        elif _TEXT.search(block.path):
            text += block.bytes
        else:
            stack.extend(block.children)
    return text, one


def calls_per_image(component: Component, work: Workload) -> int:
    """A denoiser (or ControlNet) at every call of the workload; anything else once."""
    return work.calls if component.name in PER_STEP else 1


def formula_component(component: Component, dtype_bytes: int, work: Workload) -> ComponentCounts:
    """A component's counts by the formula, for a pipeline no dry run has counted: its FLOPs from its parameters
    (``flops_per_call``), its attention's apart (priced at the backend's rate, as a count's are), memory-bound bytes
    of the rest and kernels at the catalog's median rates."""
    flops = flops_per_call(component, dtype_bytes, work) * work.images
    attention = attention_flops_per_call(component, work) * work.images  # priced at the attention backend's rate
    rate = KERNELS_PER_MODULE if component.name in PER_STEP else KERNELS_PER_MODULE_ONCE
    kernels = rate * _modules(component)
    call = Tally(flops=flops, memory_bytes=(flops - attention) * MEMORY_BYTES_PER_FLOP, kernels=kernels,
                 attention_flops=attention, attention_scores=attention / 4 / max(1, component.attention_width)
                 * max(1, component.heads))
    if component.name in PER_STEP:
        per_step = work.calls / max(1, work.steps)
        return ComponentCounts(component.name, per_step=call.scaled(per_step), calls_per_step=per_step)
    return ComponentCounts(component.name, once=call, calls_once=1.0)


def formula_counts(inventory: Inventory, work: Workload) -> Counts:
    """The whole pipeline's counts by the formula (``formula_component``), at ``work``'s steps."""
    dtype_bytes = _dtype_bytes(inventory.dtype)
    return Counts(inventory.pipeline_class, (), work.steps,
                  tuple(formula_component(c, dtype_bytes, work) for c in inventory.models), inventory.dtype, "formula")


def _modules(component: Component) -> int:
    if component.tree is None:
        return max(1, len(component.blocks)) * 10
    stack, leaves = [component.tree], 0
    while stack:
        block = stack.pop()
        leaves += 1 if block.own else 0
        stack.extend(block.children)
    return max(1, leaves)


def _dtype_bytes(dtype: str | None) -> int:
    return {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(dtype or "", 4)


# ---- one component as placed -----------------------------------------------------------------------------------


def component_cost(placement: Placement, component: Component, dtype_bytes: int, perf: Performance,
                   work: Workload, mechanism: Mechanism = PIPEMAP, counted: ComponentCounts | None = None,
                   steps: int | None = None, ranks: str | None = None) -> Cost:
    """Seconds one image spends in a component as placed: its compute (``counted``, else the formula), plus the
    moves its mode implies (``moved_per_image`` bytes, over the host link or between GPUs), less what overlaps.
    ``ranks``: what runs a split's ranks (``Plan.ranks``; threads launch one after the other), processes if None."""
    counted = counted or formula_component(component, dtype_bytes, work)
    priced = _Priced(placement, component, perf, work, mechanism, counted, work.steps if steps is None else steps,
                     ranks)
    return _PRICES[facts(placement.mode).cost](priced)


@dataclass(frozen=True)
class _Priced:
    """What pricing one placed component reads: its placement, component, machine, call, mechanism and counts."""

    placement: Placement
    component: Component
    perf: Performance
    work: Workload
    mechanism: Mechanism
    counted: ComponentCounts
    steps: int
    ranks: str | None = None

    @property
    def on_gpu(self) -> bool:
        return is_accelerator(self.placement.execution_device)

    @property
    def compute(self) -> float:
        return compute_seconds(self.counted.total(self.steps), self.perf, self.on_gpu)

    @property
    def moved(self) -> float:
        return moved_per_image(self.placement, self.component, self.work)

    @property
    def bandwidth(self) -> float:
        return self.perf.host_bandwidth * (1.0 if self.mechanism.pinned else PAGEABLE_SHARE)


def _onload_price(x: _Priced) -> Cost:
    """One onload per image: the LRU keeps it while the others' calls run."""
    transfer = copy_seconds(x.component.bytes, x.bandwidth, 1, x.mechanism.copy_latency) * (
        2 if x.mechanism.copy_back else 1)
    return Cost(x.component.name, x.compute, transfer, x.compute + transfer)


def _stream_price(x: _Priced) -> Cost:
    return _stream_cost(x.placement, x.component, x.counted, x.steps, x.perf, x.bandwidth, x.mechanism, x.on_gpu)


def _replicated_price(x: _Priced) -> Cost:
    """Each call's parts run at once on the copies, gathered at each call."""
    parts = min(GUIDANCE_BATCH, 1 + len(x.placement.replicas)) if x.work.guidance else 1
    share = shared_compute(x.counted.total(x.steps), x.perf, x.on_gpu, parts, x.ranks)
    transfer = x.moved / x.perf.peer_bandwidth + (x.counted.calls(x.steps) * COLLECTIVE_LATENCY if parts > 1 else 0.0)
    return Cost(x.component.name, share, transfer, share + transfer)


def _guidance_price(x: _Priced) -> Cost:
    return guidance_cost(x.component, x.compute, x.moved, x.perf, x.work, _thread_floor(x, x.placement))


def _sequence_price(x: _Priced) -> Cost:
    return sequence_cost(x.placement, x.component, _split_share(x, x.placement), x.moved, x.perf, x.work, x.ranks)


def _split_share(x: _Priced, split: Placement) -> float:
    """Each rank's seconds for its share of a sequence split's calls: the GPU's work shared, with its waits for the
    slowest rank at each exchange (``straggler_seconds``), the host launching the plain call's kernels and each
    exchange's own (``EXCHANGE_LAUNCHES``) on every rank."""
    gpus = 1 + len(split.replicas)
    collectives = exchanges_per_image(x.component, x.work)
    return shared_compute(x.counted.total(x.steps) + Tally(kernels=EXCHANGE_LAUNCHES * collectives), x.perf,
                          x.on_gpu, gpus, x.ranks, straggler_seconds(collectives, gpus))


def straggler_seconds(collectives: float, gpus: int) -> float:
    """The seconds each of ``gpus`` ranks waits for late peers at ``collectives`` collectives: ``STRAGGLER_WAIT``
    a collective and rank beyond two.

    >>> round(straggler_seconds(1000, 8) / STRAGGLER_WAIT)   # 1000 collectives, 6 ranks beyond two
    6000
    """
    return collectives * STRAGGLER_WAIT * max(0, gpus - 2)


def _thread_floor(x: _Priced, placement: Placement) -> float:
    """For ranks that are threads of one process, the host's seconds launching every call's kernels on every rank
    that runs it, one after the other: what guidance branches at once cannot hide. 0 for processes."""
    if x.ranks != "thread" or not x.on_gpu:
        return 0.0
    exchanges = EXCHANGE_LAUNCHES * exchanges_per_image(x.component, x.work) if token_ranks(placement) > 1 else 0
    return rank_launch_seconds(x.counted.total(x.steps).kernels + exchanges, x.perf, token_ranks(placement), x.ranks)


def _guidance_sequence_price(x: _Priced) -> Cost:
    """Each branch split across its half of the GPUs (``sequence_cost`` at that half), the second branch of each
    step after the first hidden behind the first as guidance branches at once hide it (``guidance_cost``)."""
    within = _first_branch(x.placement)
    split = sequence_cost(within, x.component, _split_share(x, within), _sequence_moved(within, x.component, x.work),
                          x.perf, x.work, x.ranks)
    both = guidance_cost(x.component, split.compute, guidance_moved(x.work), x.perf, x.work,
                         _thread_floor(x, x.placement))
    exchanges = split.transfer * waited_share(x.work)  # a hidden call's exchanges are hidden with it
    return replace(both, transfer=both.transfer + exchanges, total=both.total + exchanges)


def _first_branch(placement: Placement) -> Placement:
    """A ``"guidance_sequence"`` placement's first branch as the sequence split it is (``modes.branch_devices``)."""
    first, _ = branch_devices(placement.device, placement.replicas)
    return replace(placement, mode=Mode.SEQUENCE, replicas=first[1:])


def _in_place_price(x: _Priced) -> Cost:
    """Split: activations to each run of shards and back; resident: none."""
    transfer = x.moved / x.perf.peer_bandwidth
    return Cost(x.component.name, x.compute, transfer, x.compute + transfer)


def _stream_cost(placement: Placement, component: Component, counted: ComponentCounts, steps: int,
                 perf: Performance, bandwidth: float, mechanism: Mechanism, on_gpu: bool) -> Cost:
    """A streamed component: each call's pieces through its buffers (``stream_call_seconds``), at every call."""
    calls = max(1.0, counted.calls(steps))
    per_call = counted.per_call(steps)
    blocks = placement.blocks or tuple(component.blocks)
    kept = set(placement.resident_blocks)
    shares = _piece_work(counted, per_call, blocks, component)
    pieces = [Piece(compute_seconds(shares[path], perf, on_gpu),
                    None if path in kept else copy_seconds(size, bandwidth, 1, mechanism.copy_latency),
                    launch_seconds(shares[path], perf, on_gpu))
              for path, size in blocks]
    loose_bytes = max(0, component.bytes - sum(size for _, size in blocks))
    loose = compute_seconds(shares[LOOSE], perf, on_gpu)
    root = 0.0 if LOOSE in kept or not loose_bytes else copy_seconds(loose_bytes, bandwidth, 1,
                                                                     mechanism.copy_latency)
    sizes = [size for path, size in blocks if path not in kept]
    depth = max(1, placement.prefetch or 1)
    own = bool(sizes) and min(depth + 1, len(sizes)) * max(sizes) >= sum(sizes)
    call = call_seconds([Piece(loose, None, launch_seconds(shares[LOOSE], perf, on_gpu)), *pieces], root, depth, own,
                        mechanism)
    compute = calls * (loose + sum(p.compute for p in pieces))
    transfer = calls * (root + sum(p.copy or 0.0 for p in pieces))
    total = calls * call
    return Cost(component.name, compute, transfer, total, max(0.0, compute + transfer - total))


def _piece_work(counted: ComponentCounts, per_call: Tally, blocks: Sequence[tuple[str, int]],
                component: Component) -> dict[str, Tally]:
    """One call's work inside each piece, and what is left for the loose tensors' modules (``LOOSE``): counted by
    module where the counts say; a piece below the counted modules (the catalog's record keeps 3 levels) takes its
    share by bytes of its nearest counted module; without counts by module (the formula), shares by bytes."""
    if not counted.pieces:
        total = sum(size for _, size in blocks) or 1
        return {**{path: per_call.scaled(size / total) for path, size in blocks}, LOOSE: Tally()}
    table = _by_path(counted)
    sizes = _tree_bytes(component.tree) if component.tree is not None else {}
    counted_depth = max(len(path.split(".")) for path, _ in counted.pieces)
    found = {}
    for path, size in blocks:
        ancestor = path
        if ancestor not in table and len(path.split(".")) > counted_depth:  # below the counted modules
            ancestor = ".".join(path.split(".")[:counted_depth])
        share = 1.0 if ancestor == path else size / max(1, sizes.get(ancestor, component.bytes))
        found[path] = table.get(ancestor, Tally()).scaled(min(1.0, share))
    inside = Tally()
    for tally in found.values():
        inside = inside + tally
    rest = Tally(*(max(0.0, a - b) for a, b in zip(per_call.to_list(exact=True), inside.to_list(exact=True))))
    return {**found, LOOSE: rest}


@functools.lru_cache(maxsize=32)
def _tree_bytes(tree: Block) -> dict[str, int]:
    """The bytes under every module path of a component's tree."""
    found, stack = {}, [tree]
    while stack:
        block = stack.pop()
        found[block.path] = block.bytes
        stack.extend(block.children)
    return found


@functools.lru_cache(maxsize=64)
def _by_path(counted: ComponentCounts) -> dict[str, Tally]:
    """One call's work under every module path (a module's own and its children's)."""
    table: dict[str, Tally] = collections.defaultdict(Tally)
    for path, tally in counted.pieces:
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            key = ".".join(parts[:depth])
            table[key] = table[key] + tally
    return dict(table)


def moved_per_image(placement: Placement, component: Component, work: Workload) -> float:
    """Bytes one image moves for a component as placed: an offloaded one once (the LRU keeps it while the others
    run), a streamed one its non-resident pieces at each call, a split one its activations to each run of shards
    and back at each call, a replicated one the batch parts sent to its copies (latents and prompt, there and
    back); a resident one nothing."""
    return _MOVED[facts(placement.mode).cost](placement, component, work)


def _stream_moved(placement: Placement, component: Component, work: Workload) -> float:
    return calls_per_image(component, work) * _moved_per_call(placement, component)[0]


def _split_moved(placement: Placement, component: Component, work: Workload) -> float:
    return calls_per_image(component, work) * 2 * split_hops(placement) * work.latent_tokens * ACTIVATION_BYTES


def _replicated_moved(placement: Placement, component: Component, work: Workload) -> float:
    parts = min(GUIDANCE_BATCH, 1 + len(placement.replicas))
    return (calls_per_image(component, work) / GUIDANCE_BATCH * (parts - 1)
            * (work.latent_tokens * REPLICA_BYTES_PER_TOKEN + PROMPT_BYTES))


def _sequence_moved(placement: Placement, component: Component, work: Workload) -> float:
    gpus = 1 + len(placement.replicas)
    inputs = (gpus - 1) * (work.latent_tokens * REPLICA_BYTES_PER_TOKEN // 2 + PROMPT_BYTES)
    return calls_per_image(component, work) * (gpus * exchanged_per_call(component, work, gpus) + inputs)


def guidance_moved(work: Workload) -> float:
    """Bytes one image moves for guidance branches at once: each step after the first, the latents to the copy and
    its output back; the negative prompt's embeddings once (the copy keeps them while they stay the same tensor)."""
    return (work.steps - 1) * work.latent_tokens * REPLICA_BYTES_PER_TOKEN + PROMPT_BYTES if work.guidance else 0


def guidance_cost(component: Component, compute: float, moved: float, perf: Performance, work: Workload,
                  host_floor: float = 0.0) -> Cost:
    """Guidance branches at once: every step after the first runs its second call on the copy while the first runs
    (the first step has no step before it to start the call from), so one call of each of those steps is hidden;
    the copy's inputs and output cross the peer link and each call is checked on arrival. A call without true
    guidance (one call a step) gains nothing. ``host_floor``: the seconds the host needs for every call's launches
    when the branches' ranks share one interpreter (threads: ``_thread_floor``), which no branch hides."""
    if not work.guidance:
        return Cost(component.name, compute, 0.0, compute)
    waited = max(compute * waited_share(work), host_floor)
    transfer = moved / perf.peer_bandwidth
    return Cost(component.name, waited, transfer, waited + transfer + work.calls * VERIFY_SECONDS)


def waited_share(work: Workload) -> float:
    """The share of an image's denoiser calls that guidance branches at once do not hide: all but one call of each
    step after the first (all of them without true guidance)."""
    return 1 - (work.steps - 1) / work.calls if work.guidance else 1.0


def exchanged_per_call(component: Component, work: Workload, gpus: int) -> float:
    """Bytes one GPU sends the others at each call of a sequence split: at every attention layer its share of the
    tokens' queries, keys, values and output (at the layer's width), all but the part it keeps for itself."""
    tokens = tokens_per_call(component, work)
    if component.name in PER_STEP:  # the text stream's tokens are cut too (diffusers' ``_cp_plan``: Flux's
        tokens += work.text_tokens  # ``encoder_hidden_states``), and exchanged at the joint attention
    width = component.attention_width or _width_guess(component)
    return EXCHANGED_TENSORS * tokens / gpus * width * EXCHANGE_ITEM_BYTES * (gpus - 1) / gpus


def _width_guess(component: Component) -> int:
    # a model sized without its tensor names: square attention projections, a quarter of its weights each layer
    return int((component.bytes / EXCHANGE_ITEM_BYTES / 12) ** 0.5) * max(1, len(component.blocks))


def sequence_cost(placement: Placement, component: Component, share: float, moved: float, perf: Performance,
                  work: Workload, ranks: str | None = None) -> Cost:
    """A sequence split over ``1 + len(replicas)`` GPUs: each computes its share of the tokens (the attention too:
    all tokens for its share of the heads; ``share``: its seconds, ``shared_compute``), then waits for the
    exchanges, which Ulysses attention does not overlap; the GPUs send at once, so the link carries one GPU's share
    at a time. What grows with the ranks: each collective's latency (``rank_latency``), and the permute copies
    around each exchange (``PERMUTE_SHARE``). Ranks as threads (``ranks="thread"``) meet at a barrier pair an exchange
    (``THREAD_EXCHANGE_SECONDS``) instead of an NCCL collective."""
    gpus = 1 + len(placement.replicas)
    calls = calls_per_image(component, work)
    layers = max(1, len(component.blocks))
    each = THREAD_EXCHANGE_SECONDS if ranks == "thread" else EXCHANGE_LATENCY
    latency = calls * (layers * EXCHANGED_TENSORS * each + SEQUENCE_CALL_COLLECTIVES * COLLECTIVE_LATENCY
                       + (layers * EXCHANGED_TENSORS + SEQUENCE_CALL_COLLECTIVES) * rank_latency(gpus))
    exchanged = calls * exchanged_per_call(component, work, gpus)
    permutes = exchanged / perf.peer_bandwidth * PERMUTE_SHARE / (1 - PERMUTE_SHARE)
    transfer = moved / gpus / perf.peer_bandwidth + permutes + latency
    return Cost(component.name, share, transfer, share + transfer)


def exchanges_per_image(component: Component, work: Workload) -> float:
    """How many all-to-alls one image's calls of a sequence-split component make: ``EXCHANGED_TENSORS`` at each
    attention layer of each call."""
    return calls_per_image(component, work) * max(1, len(component.blocks)) * EXCHANGED_TENSORS


def rank_latency(gpus: int) -> float:
    """The seconds a collective among ``gpus`` ranks takes beyond one between two (``RANK_LATENCY`` a rank)."""
    return RANK_LATENCY * max(0, gpus - 2)


def _moved_per_call(placement: Placement, component: Component) -> tuple[int, int, int]:
    """Bytes, copies and the largest piece moved at each call of a streamed component."""
    if not placement.blocks:  # a plan without pieces: its top-level blocks, every one at every call
        count = max(1, len(component.blocks))
        return component.bytes, count, component.bytes // count
    kept = set(placement.resident_blocks)
    streamed = [size for path, size in placement.blocks if path not in kept]
    loose = 0 if LOOSE in kept else max(0, component.bytes - sum(size for _, size in placement.blocks))
    return sum(streamed) + loose, len(streamed) + (1 if loose else 0), max(streamed, default=loose)


# ---- a plan ----------------------------------------------------------------------------------------------------


def predict(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None,
            mechanism: Mechanism = PIPEMAP, counts: Counts | None = None) -> dict[str, Cost]:
    """Each planned component's predicted seconds per call (``sum(c.total for c in ...)`` is the call's), and the
    pipeline's own code between them (``counts.PIPELINE``) when counted. ``counts``: the call's counted work (else
    the formula's); ``work``: the call (else the pipeline's default call, ``workload_for``), whose steps price the
    counts when given, the counts' own steps otherwise."""
    steps = work.steps if work is not None else counts.steps if counts is not None else None
    if counts is not None:  # the loop's iterations: one more than the steps for PNDM
        steps = counts.iterations(steps)
    work = work or workload_for(inventory)
    dtype_bytes = _dtype_bytes(plan.dtype)
    by_name = {c.name: c for c in inventory.models}
    cached = page_cached(plan)
    experts = expert_steps(inventory.source, set(by_name), work.steps if steps is None else steps)
    found = {}
    for p in plan.components:
        if p.component not in by_name:
            continue
        component = by_name[p.component]
        counted, at, at_steps = _counted(counts, p.component), work, steps
        if experts is not None and p.component in experts:  # its own steps of the call, each as counted
            at = replace(work, steps=experts[p.component])
            at_steps, counted = at.steps, _expert_counts(p.component, counts, component, dtype_bytes, at)
        cost = component_cost(p, component, dtype_bytes, perf, at, mechanism, counted, at_steps, plan.ranks)
        whole = (counted or formula_component(component, dtype_bytes, at)).total(at.steps if at_steps is None
                                                                                  else at_steps)
        bound = is_accelerator(p.execution_device) and is_launch_bound(whole, perf, token_ranks(p))
        found[p.component] = _with_disk(replace(cost, launch_bound=bound), disk_seconds(p, component, perf, work,
                                                                                        cached))
    code = counts.get(PIPELINE) if counts is not None else None
    if code is not None and steps is not None:
        seconds = compute_seconds(code.total(steps), perf, is_accelerator(plan.execution_device))
        found[PIPELINE] = Cost(PIPELINE, seconds, 0.0, seconds)
    return found


def _expert_counts(name: str, counts: Counts | None, component: Component, dtype_bytes: int,
                   work: Workload) -> ComponentCounts:
    """One of two experts' counts a step (``experts``): a call's work as counted for whichever expert the counted
    steps ran (a two-step dry run sees the first one only; the two share an architecture), else the formula's."""
    ran = [c for c in (counts.get(e) for e in EXPERTS) if c is not None and c.calls_per_step] if counts else []
    if not ran:
        return replace(formula_component(component, dtype_bytes, work), component=name)
    calls = sum(c.calls_per_step for c in ran)  # each step calls one of them: the counted steps' calls a step
    per_call = sum((c.per_step for c in ran), start=Tally()).scaled(1 / calls)
    return ComponentCounts(name, per_step=per_call.scaled(calls), calls_per_step=calls, pieces=ran[0].pieces)


def _counted(counts: Counts | None, component: str) -> ComponentCounts | None:
    if counts is None:
        return None
    return counts.get(component) or ComponentCounts(component)  # never called in the counted call: no work


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
    reads = calls_per_image(component, work) if facts(placement.mode).peak is Peak.STREAMED else 1
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
                      mechanism: Mechanism = PIPEMAP, counts: Counts | None = None) -> float:
    """The predicted seconds of one call of the plan (the pipeline's default call unless ``work`` is given; priced
    from ``counts`` when given)."""
    return sum(c.total for c in predict(plan, inventory, perf, work, mechanism, counts).values())


def device_seconds(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None,
                   counts: Counts | None = None) -> dict[str, float]:
    """Each device's busy seconds per image: a component's time on the device it computes on, a split
    component's compute shared by its GPUs in proportion to their bytes, a replicated or sequence-split one's on
    each copy's device, a guidance-branch copy's second calls on its device, the pipeline's own code on the
    execution device."""
    busy: dict[str, float] = collections.defaultdict(float)
    placements = {p.component: p for p in plan.components}
    for name, cost in predict(plan, inventory, perf, work, counts=counts).items():
        p = placements.get(name)
        if p is None:
            busy[plan.execution_device] += cost.total
        else:
            _BUSY.get(facts(p.mode).cost, _busy_at_home)(busy, p, cost)
    return dict(busy)


def _busy_at_home(busy: dict[str, float], p: Placement, cost: Cost) -> None:
    busy[p.execution_device] += cost.total


def _busy_on_copies(busy: dict[str, float], p: Placement, cost: Cost) -> None:
    for device in (p.execution_device, *p.replicas):
        busy[device] += cost.total


def _busy_guidance(busy: dict[str, float], p: Placement, cost: Cost) -> None:
    """The copy runs about one call a step (the second), as the home GPU does."""
    busy[p.execution_device] += cost.total
    busy[p.replicas[0]] += cost.compute + cost.transfer


def _busy_split(busy: dict[str, float], p: Placement, cost: Cost) -> None:
    if not p.bytes:
        return _busy_at_home(busy, p, cost)
    away = sum(size for _, _, size in p.shards)
    busy[p.execution_device] += cost.compute * (p.bytes - away) / p.bytes + cost.transfer
    for _, device, size in p.shards:
        busy[device] += cost.compute * size / p.bytes
    return None


# each pricing kind (``modes.ModeFacts.cost``): its seconds, its bytes moved per image, the devices it keeps busy
_PRICES = {"resident": _in_place_price, "onload": _onload_price, "stream": _stream_price, "split": _in_place_price,
           "replicated": _replicated_price, "guidance": _guidance_price, "sequence": _sequence_price,
           "guidance_sequence": _guidance_sequence_price}
_MOVED = {"resident": lambda p, c, w: 0, "onload": lambda p, c, w: c.bytes, "stream": _stream_moved,
          "split": _split_moved, "replicated": _replicated_moved, "guidance": lambda p, c, w: guidance_moved(w),
          "sequence": _sequence_moved,
          "guidance_sequence": lambda p, c, w: _sequence_moved(_first_branch(p), c, w) + guidance_moved(w)}
_BUSY = {"replicated": _busy_on_copies, "sequence": _busy_on_copies, "guidance": _busy_guidance,
         "guidance_sequence": _busy_on_copies,
         "split": _busy_split}
PRICING_KINDS = frozenset(_PRICES)  # what a mode's row may name as its cost (``tests/test_modes.py``)


def images_per_second(plan: Plan, inventory: Inventory, perf: Performance, work: Workload | None = None,
                      counts: Counts | None = None) -> float | None:
    """The predicted images per second with requests overlapped (``pipemap.run_many``): each device works on one
    request at a time, so the busiest device's seconds per image set the pace. None for an empty plan."""
    slowest = max(device_seconds(plan, inventory, perf, work, counts).values(), default=0.0)
    return 1.0 / slowest if slowest > 0 else None
