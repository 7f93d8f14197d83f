"""GPU check for pipemap: offloading strategies against diffusers' own, on one GPU, in one run of a few minutes.

    python bench/gpu_check.py OUT_DIR              # on the GPU machine (bench/gpu_check.sh calls this)
    python bench/gpu_check.py OUT_DIR --dry-cpu    # here: a small pipeline on the CPU; CUDA-only methods skipped

An SDXL-shaped pipeline (the published SDXL base 1.0 configs: CLIP-L, OpenCLIP-bigG, the 2.6B UNet, the VAE) is built
with random weights on the GPU (nothing is downloaded), cast to fp16 and kept in ordinary CPU memory, as
``from_pretrained`` would leave it. Each method gets a fresh pipeline whose parameters share that CPU storage, runs
one warm-up call and timed calls, and is torn down; the methods:

  plain .to(cuda)                 everything resident: the speed floor (it ignores the budget; marked so)
  pipemap balanced                one GPU, whole GPU as budget: the same, through pipemap's hooks
  pipemap balanced_low_memory     offload budget: what does not fit is moved whole for its call (model offload)
  diffusers model offload         enable_model_cpu_offload()
  pipemap balanced_ultra_low_memory  stream budget: what does not fit is streamed block by block
  diffusers group offload         enable_group_offload(leaf_level, use_stream=True), diffusers' documented example
  diffusers sequential offload    enable_sequential_cpu_offload(), at 1 and 2 steps, scaled to the full step count
  pipemap ultra_low @ matched     the stream strategy again, its budget the peak measured for group / sequential

Each budgeted method is held to its budget (``torch.cuda.set_per_process_memory_fraction``: the allocator refuses
past it, as a GPU of that size would). Figures: seconds per image (median of the timed calls), seconds per extra
denoising step (from the calls at two step counts), peak GPU memory of the timed calls, allocated
(``max_memory_allocated``) and reserved by the caching allocator (which also holds memory freed while another
stream may still use it), each above the figure before the method's pipeline existed, host memory pinned by
pipemap, weight bytes moved host to GPU per image and what that makes per second, the largest difference of its
image and of its final latents from the first method's at the same step count, and the GPU memory left after
``pipemap.reset``. Then, each section capped: denoiser replicas and ``run_many`` (speed), pipemap's lifetime and
concurrency checks (a streamed pipeline dropped without reset, then loaded again; reset right after a call whose
latents the host never waited for; a streamed plan under ``run_many``; the disk tier: a streamed UNet read from its
safetensors file at each call, with the process's RSS against the plan's host figure; out-of-memory relief: an
out-of-memory error injected into the UNet's first call under ``run_many``, the least-used components moved to
the host within its budget), the host-to-GPU bandwidth of one pinned
packed copy, the transfer self-test (with one GPU: host copies only, no GPU pair) and ``python -m pipemap doctor``.
The whole run fits ``--time-budget`` (400 s; ``gpu_check.sh`` caps everything, installing included, at 7 minutes).
Writes ``table.md`` and ``results.json`` (rewritten after every method, so a run cut short still leaves them) into
OUT_DIR; the last line printed is ``summary: name=value ...``. bench/README.md says how to read it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"),
                     ("DIFFUSERS_VERBOSITY", "error"), ("PYTHONUNBUFFERED", "1")):
    os.environ.setdefault(_key, _value)

T0 = time.perf_counter()  # before torch's import: the time budget counts it

import torch  # noqa: E402

HEADROOM = 0.05
TOLERANCE = 2e-2  # max |difference| of images in [0, 1] computed in fp16 along different paths
LATENT_TOLERANCE = 5e-2  # the same for the final latents (scaled, about unit variance)
PROMPT = "an astronaut riding a horse on the moon, detailed photograph"
# seconds each section after the methods may take; their sum (and 5 s for the report) is kept from the methods
SECTIONS = {"speed": 45.0, "branches": 30.0, "lifetime": 120.0, "bandwidth": 15.0, "transfers": 20.0, "doctor": 30.0}
RESERVE = sum(SECTIONS.values()) + 5.0


# ---- the pipeline ----------------------------------------------------------------------------------------------


def _round(value: float, multiple: int) -> int:
    return max(multiple, int(round(value / multiple)) * multiple)


def _depth(value: int, depth: float) -> int:
    return max(1, int(round(value * depth)))


def sdxl_configs(width: float = 1.0, depth: float = 1.0) -> dict[str, dict]:
    """The SDXL base 1.0 model configs (width 1, depth 1), or the same shapes narrowed and made shallower.

    Widths stay multiples of 64 so every attention head keeps SDXL's 64 channels; the text encoders' vocabularies
    are the byte-level tokenizer's (pipemap.tiny), which changes nothing that matters for speed.
    """
    from pipemap import tiny

    unet_ch = [_round(c * width, 64) for c in (320, 640, 1280)]
    te1, te2 = _round(768 * width, 64), _round(1280 * width, 64)
    vocab = tiny.tokenizer_vocab()
    clip = dict(vocab_size=tiny.VOCAB_SIZE, max_position_embeddings=tiny.MAX_LENGTH, bos_token_id=vocab[tiny.BOS],
                eos_token_id=vocab[tiny.EOS], pad_token_id=vocab[tiny.EOS], layer_norm_eps=1e-5)
    return {
        "unet": dict(
            sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=unet_ch,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            attention_head_dim=[c // 64 for c in unet_ch],  # SDXL's config means heads here (5, 10, 20)
            transformer_layers_per_block=[_depth(n, depth) for n in (1, 2, 10)],
            cross_attention_dim=te1 + te2, use_linear_projection=True, addition_embed_type="text_time",
            addition_time_embed_dim=256, projection_class_embeddings_input_dim=6 * 256 + te2, norm_num_groups=32),
        "vae": dict(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
            block_out_channels=[_round(c * width, 32) for c in (128, 256, 512, 512)],
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            sample_size=1024, scaling_factor=0.13025, force_upcast=False),  # fp16 throughout, as the offloaders see it
        "text_encoder": dict(clip, hidden_size=te1, intermediate_size=4 * te1, num_attention_heads=te1 // 64,
                             num_hidden_layers=_depth(12, depth), hidden_act="quick_gelu", projection_dim=te1),
        "text_encoder_2": dict(clip, hidden_size=te2, intermediate_size=4 * te2, num_attention_heads=te2 // 64,
                               num_hidden_layers=_depth(32, depth), hidden_act="gelu", projection_dim=te2),
    }


def build_models(configs: dict[str, dict], device: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The four models with random weights, initialised on ``device`` (fast on a GPU), cast to ``dtype`` and left in
    ordinary (unpinned) CPU memory, each tensor contiguous."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    makers = {"unet": lambda c: UNet2DConditionModel(**c), "vae": lambda c: AutoencoderKL(**c),
              "text_encoder": lambda c: CLIPTextModel(CLIPTextConfig(**c)),
              "text_encoder_2": lambda c: CLIPTextModelWithProjection(CLIPTextConfig(**c))}
    models = {}
    for seed, (name, make) in enumerate(makers.items()):
        torch.manual_seed(seed)
        with torch.device(device):
            model = make(configs[name]).eval().requires_grad_(False)
        models[name] = model.to(dtype).to("cpu")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return models


def fresh_pipeline(models: dict[str, torch.nn.Module]):
    """A new SDXL pipeline whose models are copies of ``models`` that share their CPU storage: building one costs
    no copy of the weights, and what a method does to its copy (moving, pinning, hooking) leaves the originals."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    from pipemap import tiny

    clones = {}
    for name, model in models.items():
        memo = {id(p): torch.nn.Parameter(p.data, requires_grad=False) for p in model.parameters()}
        memo.update({id(b): b for b in model.buffers()})
        clones[name] = copy.deepcopy(model, memo)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       timestep_spacing="leading", steps_offset=1)
    pipe = StableDiffusionXLPipeline(**clones, tokenizer=tiny.build_tokenizer(), tokenizer_2=tiny.build_tokenizer(),
                                     scheduler=scheduler, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---- measuring one method --------------------------------------------------------------------------------------


@dataclass
class Method:
    """One way to run the pipeline: ``setup(pipe, device)`` prepares it, ``teardown(pipe)`` undoes it."""

    key: str
    label: str
    setup: Callable
    teardown: Callable | None = None
    budget: int | None = None  # bytes the method is held to (pipemap's plan budget); None: not budgeted
    budget_note: str = ""
    cuda_only: bool = False
    slow: bool = False  # timed at 1 and 2 steps only, once each
    plan: object = None


@dataclass
class Result:
    key: str
    label: str
    status: str = "ok"  # ok | error | needs CUDA | skipped
    note: str = ""
    budget: int | None = None
    steps: int = 0  # the step count s_per_image is at (measured or scaled)
    s_per_image: float | None = None
    s_per_image_scaled: bool = False
    s_per_step: float | None = None
    times: dict = field(default_factory=dict)  # steps -> seconds of each timed call
    first_call_s: float | None = None
    setup_s: float | None = None
    peak_bytes: int | None = None
    peak_first_bytes: int | None = None
    reserved_bytes: int | None = None  # the caching allocator's peak above the start: blind spots of allocated
    pinned_bytes: int | None = None  # host memory pinned by pipemap's hooks (exactly their groups' bytes)
    max_diff: float | None = None
    max_latent_diff: float | None = None  # of the final latents (before the VAE), same reference
    h2d_bytes: int | None = None  # weight bytes pipemap moved host to GPU per image (timed calls at --steps)
    h2d_gbps: float | None = None  # those bytes / s per image: the host-to-GPU traffic the run achieved
    finite: bool | None = None
    left_after_reset: int | None = None
    plan: str = ""
    plan_modes: dict = field(default_factory=dict)
    stats: object = None


class Runner:
    """Runs methods on fresh pipelines, keeping the first output at each step count as the reference."""

    def __init__(self, args, models, device: str):
        self.args, self.models, self.device = args, models, device
        self.cuda = device.startswith("cuda")
        self.references: dict[int, torch.Tensor] = {}
        self.latent_references: dict[int, torch.Tensor] = {}
        self.latents: torch.Tensor | None = None  # the final latents of the last call

    def call(self, pipe, steps: int, seed: int = 0) -> torch.Tensor:
        kept = []
        out = pipe(prompt=PROMPT, height=self.args.size, width=self.args.size, num_inference_steps=steps,
                   guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(seed), output_type="pt",
                   callback_on_step_end=lambda p, i, t, kw: kept.append(kw["latents"]) or {}).images
        self.latents = kept[-1].float().cpu() if kept else None  # each step's end: the last one is what is decoded
        return out.float().cpu()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def clean(self) -> int:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return self.allocated()

    def timed(self, pipe, steps: int) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        self.sync()
        start = time.perf_counter()
        out = self.call(pipe, steps)
        self.sync()
        return time.perf_counter() - start, out, self.latents

    def run(self, method: Method, cap: float) -> Result:
        result = Result(method.key, method.label, budget=method.budget, note=method.budget_note)
        if method.cuda_only and not self.cuda:
            result.status = "needs CUDA"
            return result
        base = self.clean()
        pipe = fresh_pipeline(self.models)
        try:
            with time_limit(cap), self.capped(method.budget, base):
                self._measure(method, pipe, result, base)
        except Exception as err:  # a method that fails is a row of the table, not the end of the run
            result.status = "error"
            result.note = f"{type(err).__name__}: {err}".splitlines()[0][:300] + (
                f" (budget: {method.budget_note})" if method.budget_note else "")
            traceback.print_exc()
        finally:
            self._teardown(method, pipe, result, base)
        return result

    @contextlib.contextmanager
    def capped(self, budget: int | None, base: int):
        """Hold a budgeted method to its budget on a GPU far larger: the allocator refuses past ``base + budget``
        (it raises out-of-memory as a GPU of that size would)."""
        if not self.cuda or budget is None:
            yield
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base + budget) / total), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def _measure(self, method: Method, pipe, result: Result, base: int) -> None:
        base_reserved = torch.cuda.memory_reserved(self.device) if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        method.setup(pipe, self.device)
        result.setup_s = time.perf_counter() - start
        if method.plan is not None:
            result.plan = str(method.plan)
            result.plan_modes = {p.component: p.mode for p in method.plan.components}
        full = self.args.steps
        high, low = (self.args.seq_steps, 1) if method.slow else (full, self.args.seq_steps)
        repeats = 1 if method.slow else self.args.repeats
        result.first_call_s = self.timed(pipe, low if method.slow else high)[0]
        result.peak_first_bytes = self._peak(base)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        outputs, latents, ours = {}, {}, method.key.startswith("pipemap")
        for steps, n in ((high, repeats), (low, max(1, repeats // 2))):
            moved = h2d_bytes(pipe) if ours else 0
            runs = [self.timed(pipe, steps) for _ in range(n)]
            result.times[steps] = [round(t, 5) for t, _, _ in runs]
            outputs[steps], latents[steps] = runs[-1][1], runs[-1][2]
            if ours and steps == high:
                result.h2d_bytes = (h2d_bytes(pipe) - moved) // n
        result.peak_bytes = self._peak(base)
        result.reserved_bytes = torch.cuda.max_memory_reserved(self.device) - base_reserved if self.cuda else None
        result.pinned_bytes = pinned_now() if ours else None
        self._figures(result, high, low, full)
        self._compare(result, outputs, latents)
        result.stats = pipemap_stats(pipe) if ours else None

    def _figures(self, result: Result, high: int, low: int, full: int) -> None:
        t_high, t_low = statistics.median(result.times[high]), statistics.median(result.times[low])
        result.s_per_step = (t_high - t_low) / (high - low) if high > low else None
        result.steps = full
        result.s_per_image = t_high + (full - high) * (result.s_per_step or 0.0)
        result.s_per_image_scaled = high != full
        if result.h2d_bytes is not None and not result.s_per_image_scaled and t_high > 0:
            result.h2d_gbps = result.h2d_bytes / t_high / 1e9

    def _compare(self, result: Result, outputs: dict[int, torch.Tensor], latents: dict) -> None:
        result.max_diff, finite = _largest_diff(outputs, self.references)
        result.max_latent_diff, finite_latents = _largest_diff(
            {k: v for k, v in latents.items() if v is not None}, self.latent_references)
        result.finite = finite and finite_latents

    def _peak(self, base: int) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) - base if self.cuda else None

    def _teardown(self, method: Method, pipe, result: Result, base: int) -> None:
        try:
            if method.teardown is not None:
                method.teardown(pipe)
                # the scheduler's timesteps stay on the GPU in any pipeline: not what reset must give back
                result.left_after_reset = self.clean() - base - scheduler_bytes(pipe) if self.cuda else None
        except Exception as err:
            result.note += f" | teardown: {type(err).__name__}: {err}"
            traceback.print_exc()
        del pipe
        self.clean()


def _largest_diff(found: dict[int, torch.Tensor], references: dict[int, torch.Tensor]) -> tuple[float, bool]:
    """The largest |difference| from the references (the first seen at each step count become them), and whether
    everything found is finite."""
    diffs, finite = [], True
    for steps, value in found.items():
        finite = finite and bool(torch.isfinite(value).all())
        reference = references.setdefault(steps, value)
        if reference is not value:
            diffs.append(float((torch.nan_to_num(value) - torch.nan_to_num(reference)).abs().max()))
    return (max(diffs) if diffs else 0.0), finite


def scheduler_bytes(pipe) -> int:
    """GPU bytes the scheduler's state holds (timesteps, sigmas), in the caching allocator's 512-byte blocks."""
    tensors = [t for t in vars(pipe.scheduler).values() if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)


def h2d_bytes(pipe) -> int:
    """Weight bytes pipemap's hooks moved host to GPU since dispatch, every component together."""
    import pipemap

    return sum(s["h2d_bytes"] for s in pipemap.stats(pipe).values())


class MethodTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise MethodTimeout in this thread after ``seconds`` (a Python-level interrupt: it lands between torch ops), so
    a method that runs far slower than expected (a model left on the CPU) costs a row, not the whole GPU run."""
    def expire(signum, frame):
        raise MethodTimeout(f"stopped after {seconds:.0f} s (--method-timeout or --time-budget)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pipemap_stats(pipe):
    """``pipemap.stats(pipe)`` as plain data, where pipemap has it."""
    import pipemap

    stats = getattr(pipemap, "stats", None)
    if stats is None:
        return None
    try:
        value = stats(pipe)
    except Exception as err:
        return f"pipemap.stats failed: {type(err).__name__}: {err}"
    for name in ("to_dict", "_asdict"):
        if hasattr(value, name):
            return getattr(value, name)()
    return value if isinstance(value, (dict, list, int, float, str)) else str(value)


# ---- the methods -----------------------------------------------------------------------------------------------


def pipemap_method(key: str, label: str, strategy: str, budget: int, note: str, cuda: bool,
                   call: dict | None = None) -> Method:
    """A pipemap strategy planned for one GPU of ``budget`` bytes (remapped onto the CPU in a dry run), its headroom
    the activations a dry run of ``call`` measures where given."""
    import pipemap

    method = Method(key, label, setup=None, teardown=pipemap.reset, budget=budget, budget_note=note)

    def setup(pipe, device):
        method.plan = plan_for(pipe, strategy, budget, cuda, call)
        print(method.plan)
        pipemap.dispatch(pipe, method.plan)

    method.setup = setup
    return method


def plan_for(pipe, strategy: str, budget: int, cuda: bool, call: dict | None = None):
    """``strategy`` planned for one GPU of ``budget`` bytes, remapped onto the CPU in a dry run. With ``call``, the
    headroom is what a dry run of that call measures (``headroom="measure"``), as a user with a tight GPU plans: the
    fixed 5% does not hold SDXL's VAE decode at 512x512 beside a UNet streamed to fill the rest (the H200's first
    run: out of memory in the decode)."""
    import pipemap

    room: dict = {"headroom": HEADROOM} if call is None else {"headroom": "measure", "call": call}
    plan = pipemap.plan(pipe, hardware=pipemap.Hardware.parse(f"cuda:0={budget},cpu=100GiB"), strategy=strategy,
                        **room)
    return plan if cuda else plan.remap({"cuda:0": "cpu"})


def diffusers_methods() -> list[Method]:
    def model_offload(pipe, device):
        pipe.enable_model_cpu_offload(device=device)

    def group_offload(offload_type: str, **extra):
        def setup(pipe, device):  # diffusers' documented example: leaf_level with a side stream
            pipe.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                      offload_type=offload_type, use_stream=True, **extra)
        return setup

    def sequential(pipe, device):
        pipe.enable_sequential_cpu_offload(device=device)

    return [
        Method("diffusers_model_offload", "diffusers enable_model_cpu_offload", model_offload, cuda_only=True),
        Method("diffusers_group_offload", "diffusers group offload (leaf_level, use_stream)",
               group_offload("leaf_level"), cuda_only=True),
        Method("diffusers_group_offload_block", "diffusers group offload (block_level x1, use_stream)",
               group_offload("block_level", num_blocks_per_group=1), cuda_only=True),
        Method("diffusers_sequential_offload", "diffusers enable_sequential_cpu_offload", sequential,
               cuda_only=True, slow=True),
    ]


def plain_method() -> Method:
    return Method("plain", "plain .to(device)", lambda pipe, device: pipe.to(device),
                  budget_note="no budget: the speed floor")


# ---- budgets ---------------------------------------------------------------------------------------------------


@dataclass
class Budgets:
    sizes: dict[str, int]
    in_flight: dict[str, int]
    gpu: int  # the whole GPU (plain, balanced)
    offload: int  # balanced_low_memory
    stream: int  # balanced_ultra_low_memory
    offload_note: str = ""
    stream_note: str = ""

    @classmethod
    def for_pipeline(cls, pipe, args, gpu_memory: int) -> Budgets:
        import pipemap

        inventory = pipemap.inspect(pipe)
        sizes = {c.name: c.bytes for c in inventory.models}
        in_flight = {c.name: c.in_flight for c in inventory.models}
        unet, other = sizes["unet"], max(v for k, v in sizes.items() if k != "unet")
        # offload: the UNet resident beside room to onload the largest other model, and a little more: nothing but
        # the UNet fits to stay, so the text encoders (and the VAE) must be moved in for their calls
        offload, offload_note = parse_budget(args.offload_budget, unet) or (
            int((unet + 1.1 * other) / (1 - HEADROOM)), "UNet + 1.1 x largest other, / (1 - headroom)")
        stream, stream_note = parse_budget(args.stream_budget, unet) or (int(unet * 0.6), "0.6 x UNet")
        offload, offload_note = feasible(inventory, "balanced_low_memory", offload, offload_note, gpu_memory)
        stream, stream_note = feasible(inventory, "balanced_ultra_low_memory", stream, stream_note, gpu_memory)
        return cls(sizes, in_flight, gpu_memory, offload, stream, offload_note, stream_note)


def plans(inventory, strategy: str, budget: int) -> bool:
    import pipemap

    try:
        pipemap.plan(inventory, hardware=pipemap.Hardware.parse(f"cuda:0={budget},cpu=100GiB"), strategy=strategy,
                     headroom=HEADROOM)
        return True
    except pipemap.DoesNotFitError:
        return False


def feasible(inventory, strategy: str, budget: int, note: str, ceiling: int) -> tuple[int, str]:
    """``budget`` if ``strategy`` plans under it, else the smallest budget that plans (to 1 MiB), said in the note:
    a row that only says "does not fit" would waste the GPU run."""
    if plans(inventory, strategy, budget):
        return budget, note
    low, high = budget, ceiling
    if not plans(inventory, strategy, high):
        return budget, note + " (no budget up to the whole GPU plans)"
    while high - low > 2**20:
        middle = (low + high) // 2
        low, high = (low, middle) if plans(inventory, strategy, middle) else (middle, high)
    return high, f"{note} = {gib(budget)} GiB does not plan; raised to the smallest that does"


def parse_budget(text: str | None, unet: int) -> tuple[int, str] | None:
    """``"auto"`` -> None; ``"0.6"`` -> (that fraction of the UNet's bytes, note); ``"6GiB"`` -> (bytes, note)."""
    from pipemap import parse_bytes

    if not text or text == "auto":
        return None
    try:
        return int(float(text) * unet), f"{text} x UNet (given)"
    except ValueError:
        return parse_bytes(text), f"{text} (given)"


# ---- the run ---------------------------------------------------------------------------------------------------


def methods_in_order(args, budgets: Budgets, cuda: bool) -> list[Method]:
    diff = {m.key: m for m in diffusers_methods()}
    return [
        plain_method(),
        pipemap_method("pipemap_balanced", "pipemap balanced (1 GPU)", "balanced", budgets.gpu, "whole GPU", cuda),
        pipemap_method("pipemap_low_memory", "pipemap balanced_low_memory", "balanced_low_memory", budgets.offload,
                       budgets.offload_note, cuda),
        diff["diffusers_model_offload"],
        pipemap_method("pipemap_ultra_low_memory", "pipemap balanced_ultra_low_memory", "balanced_ultra_low_memory",
                       budgets.stream, budgets.stream_note, cuda, call=shape(args)),
        diff["diffusers_group_offload"],
        diff["diffusers_group_offload_block"],
        diff["diffusers_sequential_offload"],
    ]


def shape(args) -> dict:
    """The timed calls' shape, for a dry run that measures their activations (``plan_for``)."""
    return dict(prompt=PROMPT, height=args.size, width=args.size, guidance_scale=5.0)


MATCHED = (("diffusers_group_offload", "group"), ("diffusers_group_offload_block", "group_block"),
           ("diffusers_sequential_offload", "sequential"))


def matched_methods(results: dict[str, Result], cuda: bool, call: dict | None = None) -> list[Method]:
    """balanced_ultra_low_memory again, its budget the peak a diffusers offloader reached (equal memory)."""
    out = []
    for key, short in MATCHED:
        peer = results.get(key)
        if peer is not None and peer.status == "ok" and peer.peak_bytes:
            out.append(pipemap_method(f"pipemap_ultra_low_memory_at_{short}", f"pipemap ultra_low @ {short} peak",
                                      "balanced_ultra_low_memory", peer.peak_bytes, f"= peak of {short} offload",
                                      cuda, call))
    return out


def run_all(args, runner: Runner, budgets: Budgets, report: Callable) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for method in methods_in_order(args, budgets, runner.cuda):
        run_one(args, runner, method, results, report)
    if args.matched:
        for method in matched_methods(results, runner.cuda, shape(args)):
            run_one(args, runner, method, results, report)
    return results


def run_one(args, runner: Runner, method: Method, results: dict[str, Result], report: Callable) -> None:
    if args.only and not any(method.key.startswith(k) for k in args.only.split(",")):
        return
    cap = min(args.method_timeout * (2 if method.slow else 1), args.time_budget - RESERVE - elapsed())
    if method.cuda_only and not runner.cuda:
        results[method.key] = Result(method.key, method.label, "needs CUDA")
    elif cap < 10:
        results[method.key] = Result(method.key, method.label, "skipped", f"--time-budget {args.time_budget:.0f} s "
                                     "spent", budget=method.budget)
    else:
        print(f"\n== {method.label} (t={elapsed():.0f} s, at most {cap:.0f} s)", flush=True)
        results[method.key] = runner.run(method, cap)
        print(line_of(results[method.key]), flush=True)
    report(results)


def elapsed() -> float:
    return time.perf_counter() - T0


# ---- speed from a second GPU -----------------------------------------------------------------------------------

SPEED_SPEC = "2x200GiB,cpu=1TiB"  # room for everything: the layout is measured here, not a budget


def speed_check(args, models, device: str) -> dict:
    """Denoiser replicas (strategy "parallel") against one device, seconds per image; ``pipemap.run_many`` (2
    workers, 4 calls) against the same calls one by one on a 2-stage layout, images per second. With two GPUs
    they run on two; with one, both layouts are remapped onto it (the copies share its weights and its compute):
    the control, which shows what the threads alone cost or give."""
    import pipemap

    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    to = {"cuda:0": device, "cuda:1": "cuda:1" if gpus >= 2 else device}
    out: dict = {"layout": "two GPUs" if gpus >= 2 else f"both 'GPUs' on {device} (the control)"}
    pipe = fresh_pipeline(models)
    plans = {"one": pipemap.plan(pipe, hardware=SPEED_SPEC.replace("2x", "1x", 1)).remap({"cuda:0": device}),
             "replicas": pipemap.plan(pipe, hardware=SPEED_SPEC, strategy="parallel").remap(to),
             "stages": pipemap.plan(pipe, hardware=SPEED_SPEC).remap(to)}
    out["plans"] = {k: p.device_map | {"unet_mode": p.placement("unet").mode} for k, p in plans.items()}
    images = {}
    for name in ("one", "replicas"):
        pipemap.dispatch(pipe, plans[name], check_transfers=False)
        images[name], out[f"{name}_s_per_image"] = _timed_calls(args, pipe, 1, max(1, args.repeats))
        pipemap.reset(pipe)
    out["replicas_max_diff"] = float((images["one"] - images["replicas"]).abs().max())
    pipemap.dispatch(pipe, plans["stages"], check_transfers=False)
    calls = lambda: [dict(prompt=f"{PROMPT} {i}", height=args.size, width=args.size,  # noqa: E731
                          num_inference_steps=args.steps, guidance_scale=5.0, output_type="pt",
                          generator=torch.Generator("cpu").manual_seed(i)) for i in range(4)]
    pipemap.run_many(pipe, calls()[:2], workers=2)  # warm-up
    out["one_by_one_images_per_s"] = 4 / _clock(lambda: [pipe(**c) for c in calls()])
    out["run_many_images_per_s"] = 4 / _clock(lambda: pipemap.run_many(pipe, calls(), workers=2))
    pipemap.reset(pipe)
    out["replicas_speedup"] = out["one_s_per_image"] / out["replicas_s_per_image"]
    out["run_many_speedup"] = out["run_many_images_per_s"] / out["one_by_one_images_per_s"]
    return out


def branches_check(args, device: str) -> dict:
    """Guidance branches at once and a sequence split (strategy "parallel" for pipelines that call their denoiser
    once per guidance branch, and for one call's tokens) against the same calls on one GPU, on transformers of the
    published shapes cut to a few blocks, random weights: a Wan 2.1-shaped one in a loop of two calls a step (as
    WanPipeline calls it), a Flux.1-shaped one on one 1024x1024 call. With two GPUs the copy lives on the second;
    with one, on the same (the control: the threads and checks alone); --dry-cpu: tiny shapes on the CPU."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from pipemap.hooks import GuidanceHook, SequenceHook

    dtype, dry = getattr(torch, args.dtype), device == "cpu"
    other = "cuda:1" if torch.cuda.device_count() >= 2 else device
    out: dict = {"branches_layout": f"{device} + {other}"}
    with torch.device(device):
        wan = WanTransformer3DModel(
            **(dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2, text_dim=32, freq_dim=256)
               if dry else dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=4)),
            in_channels=16, out_channels=16).to(dtype).eval()
        flux = FluxTransformer2DModel(
            **(dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                    joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]) if dry
               else dict(num_layers=2, num_single_layers=4, guidance_embeds=True))).to(dtype).eval()
    # Wan latents at 81x480x832 are 21x60x104; 6 of the 21 latent frames here
    (frames, height, width), steps = ((2, 8, 8), 3) if dry else ((6, 60, 104), args.steps)
    latents = torch.randn(1, 16, frames, height, width, device=device, dtype=dtype)
    text = [torch.randn(1, 512 if not dry else 8, 4096 if not dry else 32, device=device, dtype=dtype)
            for _ in range(2)]

    def denoise(module):
        x = latents
        for t in torch.linspace(999, 1, steps, device=device):
            timestep = t.expand(1)
            cond = module(hidden_states=x, timestep=timestep, encoder_hidden_states=text[0], return_dict=False)[0]
            uncond = module(hidden_states=x, timestep=timestep, encoder_hidden_states=text[1], return_dict=False)[0]
            x = x - 0.05 * (uncond + 5.0 * (cond - uncond))
        return x

    out.update(_against_one(wan, GuidanceHook, device, other, denoise, "guidance"))
    tokens, width = (16, 32) if dry else (4096, 3072)
    inputs = dict(hidden_states=torch.randn(1, tokens, 64, device=device, dtype=dtype),
                  encoder_hidden_states=torch.randn(1, 512 if not dry else 8, 4096 if not dry else 32, device=device,
                                                    dtype=dtype),
                  pooled_projections=torch.randn(1, 768 if not dry else 32, device=device, dtype=dtype),
                  timestep=torch.tensor([0.5], device=device, dtype=dtype),
                  img_ids=torch.zeros(tokens, 3, device=device), txt_ids=torch.zeros(512 if not dry else 8, 3,
                                                                                     device=device),
                  guidance=None if dry else torch.tensor([3.5], device=device, dtype=dtype), return_dict=False)
    out.update(_against_one(flux, SequenceHook, device, other, lambda m: m(**inputs)[0], "sequence"))
    out["sequence_width"] = width
    return out


def _against_one(module, hook_class, device: str, other: str, run, name: str) -> dict:
    """Seconds of ``run(module)`` plain and with ``hook_class`` (a copy on ``other``), the speed-up, the largest
    difference of the outputs, and what the hook counted."""
    from pipemap.hooks import hook_component, unhook_component
    from pipemap.plan import Placement

    with torch.no_grad():
        run(module)  # warm-up
        plain_s = _clock(lambda: run(module))
        want = run(module)
        hook = hook_class.for_placement(Placement(name, device, 0, name, replicas=(other,)), device, None)
        hook_component(module, hook)
        try:
            run(module)
            mapped_s = _clock(lambda: run(module))
            got = run(module)
        finally:
            unhook_component(module)
    counted = {k: getattr(hook, k) for k in ("hits", "misses", "whole") if hasattr(hook, k)}
    return {f"{name}_plain_s": plain_s, f"{name}_s": mapped_s, f"{name}_speedup": plain_s / mapped_s,
            f"{name}_max_diff": float((got.float() - want.float()).abs().max()),
            **{f"{name}_{k}": v for k, v in counted.items()}}


def _sync() -> None:
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def _clock(run) -> float:
    _sync()
    start = time.perf_counter()
    run()
    _sync()
    return time.perf_counter() - start


def _timed_calls(args, pipe, warm: int, repeats: int) -> tuple[torch.Tensor, float]:
    call = lambda: pipe(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps,  # noqa: E731
                        guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(0), output_type="pt").images
    for _ in range(warm):
        image = call()
    times = [_clock(call) for _ in range(repeats)]
    return image.float().cpu(), statistics.median(times)


# ---- lifetime and concurrency ----------------------------------------------------------------------------------


@dataclass
class Check:
    """One lifetime or concurrency check: whether it held, with what it measured."""

    name: str
    passed: bool | None = None
    figures: dict = field(default_factory=dict)
    note: str = ""


def lifetime_checks(args, runner: Runner, budgets: Budgets, cap: float) -> dict[str, Check]:
    """pipemap's lifetime and concurrency checks on a streamed plan (the stream budget), each a row; together
    within ``cap`` seconds, each within what is left of it."""
    checks = {}
    end = time.perf_counter() + cap
    for name, check in (("del_without_reset_then_reload", _del_then_reload), ("reset_right_after_a_call",
                         _reset_after_call), ("streamed_plan_under_run_many", _streamed_run_many),
                        ("disk_tier_streamed", _disk_tier), ("relief_within_host_budget", _relief)):
        left = end - time.perf_counter()
        if left < 5:
            checks[name] = Check(name, None, note="skipped: the section's time is spent")
            continue
        print(f"\n== check {name} (t={elapsed():.0f} s, at most {left:.0f} s)", flush=True)
        try:
            with time_limit(left):
                checks[name] = check(args, runner, budgets)
        except Exception as err:  # a check that fails is a row, not the end of the run
            checks[name] = Check(name, False, note=f"{type(err).__name__}: {err}".splitlines()[0][:300])
            traceback.print_exc()
        finally:
            runner.clean()
        print(f"   {checks[name]}", flush=True)
    return checks


def _streamed(runner: Runner, budgets: Budgets):
    import pipemap

    pipe = fresh_pipeline(runner.models)
    pipemap.dispatch(pipe, plan_for(pipe, "balanced_ultra_low_memory", budgets.stream, runner.cuda))
    return pipe


def _del_then_reload(args, runner: Runner, budgets: Budgets) -> Check:
    """A streamed pipeline dropped without reset (a notebook re-run, a reloaded model), then built and placed again:
    its pinned memory and GPU buffers go with it, and the next placement of the same shapes works."""
    base = runner.clean()
    pipe = _streamed(runner, budgets)
    first = runner.call(pipe, 1)
    pinned = pinned_now()
    del pipe
    left = runner.clean() - base  # collects the pipeline: its groups unregister their pinned buffers
    figures = {"pinned_before_bytes": pinned, "pinned_after_del_bytes": pinned_now(), "gpu_left_after_del_bytes": left}
    pipe = _streamed(runner, budgets)
    figures["reload_max_diff"] = float((runner.call(pipe, 1) - first).abs().max())
    _reset(pipe)
    passed = figures["pinned_after_del_bytes"] == 0 and left <= 0 and figures["reload_max_diff"] <= TOLERANCE
    return Check("del_without_reset_then_reload", passed, figures)


def _reset_after_call(args, runner: Runner, budgets: Budgets) -> Check:
    """Reset right after a call whose latents stay on the GPU (the host never waited): the copies out of pinned
    memory still queued must run before it is unpinned, or the latents are garbage."""
    steps = args.seq_steps
    pipe = _streamed(runner, budgets)
    latents = pipe(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=steps, guidance_scale=5.0,
                   generator=torch.Generator("cpu").manual_seed(0), output_type="latent").images
    _reset(pipe)  # no synchronisation before it
    latents = latents.float().cpu()
    reference = runner.latent_references.get(steps)
    diff = float((torch.nan_to_num(latents) - reference).abs().max()) if reference is not None else None
    passed = bool(torch.isfinite(latents).all()) and (diff is None or diff <= LATENT_TOLERANCE)
    note = "" if reference is not None else "no reference latents at this step count (plain did not run)"
    return Check("reset_right_after_a_call", passed, {"latent_max_diff": diff}, note)


def _streamed_run_many(args, runner: Runner, budgets: Budgets) -> Check:
    """A streamed plan under ``run_many(workers=2)``: the same images as one by one, and what the overlap gives."""
    import pipemap

    pipe = _streamed(runner, budgets)
    calls = [dict(prompt=f"{PROMPT} {i}", height=args.size, width=args.size, num_inference_steps=args.seq_steps,
                  guidance_scale=5.0, output_type="pt", generator=torch.Generator("cpu").manual_seed(i))
             for i in range(3)]
    fresh = lambda: [dict(c, generator=torch.Generator("cpu").manual_seed(i)) for i, c in enumerate(calls)]  # noqa: E731
    one_by_one: list = []
    alone = _clock(lambda: one_by_one.extend(pipe(**c).images.float().cpu() for c in fresh()))
    together: list = []
    overlapped = _clock(lambda: together.extend(o.images.float().cpu() for o in pipemap.run_many(pipe, fresh(), 2)))
    _reset(pipe)
    diff = max(float((a - b).abs().max()) for a, b in zip(one_by_one, together))
    figures = {"max_diff": diff, "one_by_one_s": alone, "run_many_s": overlapped}
    return Check("streamed_plan_under_run_many", diff <= TOLERANCE and len(together) == 3, figures)


def _reset(pipe) -> None:
    import pipemap

    pipemap.reset(pipe)


DISK_RSS_MARGIN = 512 * 2**20  # the host's RSS over the plan's RAM figure the disk tier may show (allocator slack)


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _disk_tier(args, runner: Runner, budgets: Budgets) -> Check:
    """The pipeline saved, then planned with RAM for a third of the UNet and loaded: its streamed pieces are read
    from their safetensors files' maps at each call (the disk tier), through the staging ring. The image equals
    plain's; the process's RSS grows by at most the plan's RAM figure (``plan.host``) plus ``DISK_RSS_MARGIN``."""
    import tempfile

    import pipemap

    steps = args.seq_steps
    reference = runner.references.get(steps)
    with tempfile.TemporaryDirectory(prefix="pipemap-disk-") as folder:
        fresh_pipeline(runner.models).save_pretrained(folder)
        unet = budgets.sizes["unet"]
        plan = pipemap.plan(folder, hardware=f"cuda:0={budgets.stream},cpu={unet // 3}",
                            strategy="balanced_ultra_low_memory", headroom=HEADROOM, dtype=args.dtype)
        host = plan.host
        ram = host.resident + host.offloaded + host.streamed + host.staging
        gc.collect()
        before = _rss()
        pipe = pipemap.load(folder, plan=plan if runner.cuda else plan.remap({"cuda:0": "cpu"}), progress=False)
        pipe.set_progress_bar_config(disable=True)
        image = runner.call(pipe, steps)
        again = runner.call(pipe, steps)  # read from the files again: the same bytes
        grown = _rss() - before
        _reset(pipe)
        del pipe
    diff = float((image - reference).abs().max()) if reference is not None else None
    figures = {"disk_bytes": host.disk, "plan_ram_bytes": ram, "rss_growth_bytes": grown, "max_diff": diff,
               "repeat_max_diff": float((image - again).abs().max())}
    passed = (host.disk > 0 and grown <= ram + DISK_RSS_MARGIN and figures["repeat_max_diff"] == 0
              and (diff is None or diff <= TOLERANCE))
    note = "" if reference is not None else f"no {steps}-step reference image (plain did not run)"
    return Check("disk_tier_streamed", passed, figures, note)


def _relief(args, runner: Runner, budgets: Budgets) -> Check:
    """Every component resident, then an out-of-memory error (CUDA's text) in the UNet's first call under
    ``run_many``: relief moves the least-used components to the host (pinned) within the plan's CPU budget, the
    call runs again, and the images equal one by one's."""
    import pipemap
    from pipemap.api import memory_for

    pipe = fresh_pipeline(runner.models)
    sizes = budgets.sizes
    cpu = sizes["vae"] + sizes["text_encoder"] + 2**20  # room for the small ones, not the second text encoder
    plan = pipemap.plan(pipe, hardware=f"cuda:0={budgets.gpu},cpu={cpu}", strategy="balanced", headroom=HEADROOM)
    pipemap.dispatch(pipe, plan if runner.cuda else plan.remap({"cuda:0": "cpu"}))
    admission = memory_for(pipe, plan)
    alone = [runner.call(pipe, 1, seed) for seed in range(2)]
    failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity "
                                       "of 80.00 GiB of which 10.00 MiB is free. (injected by gpu_check)")]
    leaf = next(m for m in pipe.unet.modules() if m is not pipe.unet and not list(m.children()))
    handle = leaf.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(failures.pop()) if failures else None)
    calls = [dict(prompt=PROMPT, height=args.size, width=args.size, num_inference_steps=1, guidance_scale=5.0,
                  output_type="pt", generator=torch.Generator("cpu").manual_seed(seed)) for seed in range(2)]
    try:
        outputs = [o.images.float().cpu() for o in pipemap.run_many(pipe, calls, workers=2, plan=plan)]
    finally:
        handle.remove()
    moved = admission.moves[0].moved if admission.moves else ()
    pinned = pinned_now()
    cpu_used = next((d.used for d in admission.plan.devices if d.device == "cpu"), 0)
    _reset(pipe)
    diff = max(float((a - b).abs().max()) for a, b in zip(alone, outputs))
    figures = {"moved": list(moved), "cpu_budget_bytes": cpu, "cpu_used_after_bytes": cpu_used,
               "pinned_bytes": pinned, "max_diff": diff}
    passed = bool(moved) and cpu_used <= cpu and pinned <= cpu and diff <= TOLERANCE
    return Check("relief_within_host_budget", passed, figures)


def bandwidth_check(args, device: str, cap: float) -> dict:
    """Host-to-GPU bandwidth of one pinned packed copy as pipemap makes them (one ``cudaHostRegister``ed buffer,
    one ``copy_`` on a side stream), timed with events: the ceiling the streamed rows' ``h2d GB/s`` is read
    against."""
    if not device.startswith("cuda"):
        return {"note": "needs CUDA"}
    from pipemap.hooks import packing

    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    packing._pin_host(host)
    try:
        with time_limit(cap):
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                target.copy_(host, non_blocking=True)  # warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(3):
                    target.copy_(host, non_blocking=True)
                end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000 or float("nan")  # a fake CUDA's events take no time
    finally:
        torch.cuda.synchronize(device)
        packing._unpin_host(host)
    return {"bytes": 3 * nbytes, "seconds": seconds, "gb_per_s": 3 * nbytes / seconds / 1e9}


def capped(name: str, args, run: Callable):
    """``run(cap)``, which keeps within ``cap`` seconds: the section's share, or what is left of
    ``--time-budget``; its error, or that it was skipped, as its result."""
    cap = min(SECTIONS[name], args.time_budget - elapsed() - 5)
    if cap < 5:
        return {"skipped": f"--time-budget {args.time_budget:.0f} s spent"}
    print(f"\n== {name} (t={elapsed():.0f} s, at most {cap:.0f} s)", flush=True)
    try:
        return run(cap)
    except Exception as err:  # the other figures stand without these
        return {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}


def within(cap: float, run: Callable, *args):
    with time_limit(cap):
        return run(*args)


# ---- transfers and doctor --------------------------------------------------------------------------------------


def transfer_check(cuda: bool) -> dict:
    """``pipemap.check_transfers(refresh=True)`` timed (every GPU pair; one GPU has none), and the GPU with the CPU."""
    import pipemap

    out = {}
    runs = [("gpus", None)] + ([("host copies (cuda:0 <-> cpu, no GPU pair)", ["cuda:0", "cpu"])] if cuda else [])
    for name, devices in runs:
        start = time.perf_counter()
        try:
            report = pipemap.check_transfers(devices, refresh=True)
            pairs = {f"{s}->{d}": v for (s, d), v in report.pairs.items()}
            out[name] = {"seconds": time.perf_counter() - start, "pairs": pairs, "ok": report.ok,
                         "text": str(report)}
            if not pairs:
                out[name]["note"] = "no GPU pair: this machine has fewer than two GPUs; the next row is host copies"
        except Exception as err:
            out[name] = {"seconds": time.perf_counter() - start, "error": f"{type(err).__name__}: {err}"}
    return out


def pinned_now() -> int:
    from pipemap.hooks import packing

    return packing.pinned_bytes()


def doctor(timeout: float = 45.0) -> str:
    try:
        done = subprocess.run([sys.executable, "-m", "pipemap", "doctor"], capture_output=True, text=True,
                              timeout=timeout)
        return done.stdout + (f"\n(stderr)\n{done.stderr}" if done.returncode else "")
    except Exception as err:
        return f"pipemap doctor failed: {type(err).__name__}: {err}"


# ---- the report ------------------------------------------------------------------------------------------------


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def line_of(r: Result) -> str:
    if r.status != "ok":
        return f"   {r.status}: {r.note}"
    scaled = " (scaled)" if r.s_per_image_scaled else ""
    return (f"   {secs(r.s_per_image)} s/image{scaled}, {secs(r.s_per_step)} s/step, peak {gib(r.peak_bytes)} GiB "
            f"allocated, {gib(r.reserved_bytes)} GiB reserved, pinned {gib(r.pinned_bytes)} GiB, h2d "
            f"{gbps(r.h2d_gbps)} GB/s, max|diff| {r.max_diff:.2e} (latents {r.max_latent_diff or 0:.2e}), modes "
            f"{r.plan_modes or '-'}")


def gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


PEERS = {  # method -> the peer its ratios are taken against
    "pipemap_balanced": "plain", "pipemap_low_memory": "diffusers_model_offload",
    "pipemap_ultra_low_memory": "diffusers_group_offload",
    "pipemap_ultra_low_memory_at_group": "diffusers_group_offload",
    "pipemap_ultra_low_memory_at_group_block": "diffusers_group_offload_block",
    "pipemap_ultra_low_memory_at_sequential": "diffusers_sequential_offload",
}


COLUMNS = ("method", "budget GiB", "s/image", "s/step", "peak GiB", "reserved GiB", "pinned GiB", "h2d GB/s",
           "vs peer: time, peak", "max abs diff: image, latents", "setup s", "after reset GiB", "modes / note")


def methods_table(results: dict[str, Result]) -> list[str]:
    rows = ["| " + " | ".join(COLUMNS) + " |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in results.values():
        if r.status != "ok":
            rows.append(f"| {r.label} | {gib(r.budget)} | {r.status} | | | | | | | | | | {r.note} |")
            continue
        image = secs(r.s_per_image) + (" *" if r.s_per_image_scaled else "")
        rows.append(f"| {r.label} | {gib(r.budget)} | {image} | {secs(r.s_per_step)} | {gib(r.peak_bytes)} | "
                    f"{gib(r.reserved_bytes)} | {gib(r.pinned_bytes)} | {gbps(r.h2d_gbps)} | "
                    f"{versus(r, results)} | {r.max_diff:.1e}, {r.max_latent_diff or 0:.1e} | {secs(r.setup_s)} | "
                    f"{gib(r.left_after_reset)} | {row_note(r)} |")
    return rows


def versus(r: Result, results: dict[str, Result]) -> str:
    """``time ratio, peak ratio of peer`` (ours / peer: below 1 is faster / smaller)."""
    peer = results.get(PEERS.get(r.key, ""))
    if peer is None or peer.status != "ok":
        return "-"
    t, m = ratio(r.s_per_image, peer.s_per_image), ratio(r.peak_bytes, peer.peak_bytes)
    return f"{t:.2f}x, {m:.2f}x of {peer.key}" if m is not None else f"{t:.2f}x of {peer.key}"


def row_note(r: Result) -> str:
    modes = ", ".join(f"{k}={v}" for k, v in r.plan_modes.items() if v != "resident")
    modes = modes or ("all resident" if r.plan_modes else "")
    return "; ".join(x for x in (modes, r.note, "" if r.finite in (None, True) else "NON-FINITE output") if x)


@dataclass
class Target:
    name: str
    value: float | None
    goal: str
    passed: bool | None
    detail: str = ""


def targets(results: dict[str, Result], checks: dict | None = None) -> list[Target]:
    """The goals the run is read against: speed and peak against the peers, images and latents alike, nothing left
    after reset, every budgeted pipemap row's reserved memory within its budget, and the lifetime checks."""
    out = _peer_targets(results)
    ran = [r for r in results.values() if r.status == "ok"]
    latent = max((r.max_latent_diff for r in ran if r.max_latent_diff is not None), default=None)
    out.append(Target("max_latent_diff", latent, f"<= {LATENT_TOLERANCE:g}", None if latent is None else
                      latent <= LATENT_TOLERANCE, "final latents against the first method's"))
    for r in ran:
        if r.key.startswith("pipemap") and r.budget is not None and r.reserved_bytes is not None:
            share = r.reserved_bytes / r.budget
            out.append(Target(f"{r.key}_reserved_within_budget", share, "<= 1.0", share <= 1.0,
                              "caching allocator's reserved peak / the plan's budget"))
    for check in (c for c in (checks or {}).values() if isinstance(c, Check)):
        out.append(Target(check.name, None, "holds", check.passed, check.note or ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in check.figures.items())))
    return out


def _peer_targets(results: dict[str, Result]) -> list[Target]:
    def ok(key):
        r = results.get(key)
        return r if r is not None and r.status == "ok" else None

    out = []
    for peer_key, name in MATCHED:
        speed = 5.0 if name == "sequential" else 1.2
        peer = ok(peer_key)
        for ours, suffix in ((ok("pipemap_ultra_low_memory"), ""), (ok(f"pipemap_ultra_low_memory_at_{name}"),
                                                                      "_matched")):
            if suffix and ours is None:
                continue
            faster = ratio(peer.s_per_image, ours.s_per_image) if ours and peer else None
            memory = ratio(ours.peak_bytes, peer.peak_bytes) if ours and peer else None
            label = "ultra_low" + (f" @ {name} peak" if suffix else "")
            out.append(Target(f"ultra{suffix}_vs_{name}_speed", faster, f">= {speed:g}x",
                              None if faster is None else faster >= speed, f"{name} s/image / {label} s/image"))
            out.append(Target(f"ultra{suffix}_vs_{name}_peak", memory, "<= 1.0",
                              None if memory is None else memory <= 1.0, f"{label} peak / {name} peak"))
    low, model = ok("pipemap_low_memory"), ok("diffusers_model_offload")
    slower = ratio(low.s_per_image, model.s_per_image) if low and model else None
    out.append(Target("lowmem_vs_model_time", slower, "<= 1.0", None if slower is None else slower <= 1.0,
                      "balanced_low_memory s/image / model offload s/image"))
    ran = [r for r in results.values() if r.status == "ok"]
    worst = max((r.max_diff for r in ran), default=None)
    all_finite = all(r.finite for r in ran)
    out.append(Target("max_abs_diff", worst, f"<= {TOLERANCE:g}", None if worst is None else
                      (worst <= TOLERANCE and all_finite), "" if all_finite else "some output is not finite"))
    left = [r.left_after_reset for r in ran if r.left_after_reset is not None]
    out.append(Target("left_after_reset_bytes", max(left) if left else None, "0", (max(left) <= 0) if left else None,
                      "GPU bytes still allocated after pipemap.reset"))
    return out


def targets_table(found: list[Target]) -> list[str]:
    rows = ["| target | value | goal | met | what |", "| --- | ---: | --- | --- | --- |"]
    for t in found:
        value = "-" if t.value is None else f"{t.value:.3g}"
        met = {None: "n/a", True: "yes", False: "**no**"}[t.passed]
        rows.append(f"| {t.name} | {value} | {t.goal} | {met} | {t.detail} |")
    return rows


def environment(args, device: str) -> dict:
    import diffusers
    import transformers

    import pipemap

    env = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
           "pipemap": pipemap.__version__, "git": git_head()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory"] = torch.cuda.get_device_properties(device).total_memory
    try:
        import accelerate

        env["accelerate"] = accelerate.__version__
    except ImportError:
        pass
    return env


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


@dataclass
class Report:
    """Everything the run found; written to OUT_DIR after every method."""

    out: Path
    args: dict
    env: dict
    budgets: dict
    results: dict = field(default_factory=dict)
    transfers: dict = field(default_factory=dict)
    doctor: str = ""
    speed: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)

    def write(self) -> str:
        found = targets(self.results, self.checks)
        text = "\n".join(self.markdown(found)) + "\n"
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "table.md").write_text(text, encoding="utf-8")
        data = {"args": self.args, "env": self.env, "budgets": self.budgets, "targets": [asdict(t) for t in found],
                "results": {k: asdict(v) for k, v in self.results.items()}, "transfers": self.transfers,
                "doctor": self.doctor, "summary": self.summary(found), "elapsed_s": elapsed(), "speed": self.speed,
                "checks": {k: asdict(v) if isinstance(v, Check) else v for k, v in self.checks.items()},
                "bandwidth": self.bandwidth}
        (self.out / "results.json").write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
        return text

    def markdown(self, found: list[Target]) -> list[str]:
        env, b, a = self.env, self.budgets, self.args
        head = [f"# pipemap GPU check ({env.get('gpu', env['device'])})", "",
                f"torch {env['torch']} (CUDA {env['cuda']}), diffusers {env['diffusers']}, transformers "
                f"{env['transformers']}, accelerate {env.get('accelerate', '-')}, pipemap {env['pipemap']} "
                f"@ {env['git']}; python {env['python']}", "",
                f"Pipeline: SDXL-shaped (width {a['width']}, depth {a['depth']}), random weights, {a['dtype']}, "
                f"{a['size']}x{a['size']}, {a['steps']} steps, CFG; sizes GiB: "
                + ", ".join(f"{k} {gib(v)}" for k, v in b["sizes"].items()) + "; UNet in flight when streamed "
                f"{gib(b['in_flight'].get('unet'))} GiB.",
                f"Budgets (GiB, headroom {HEADROOM:g}): offload {gib(b['offload'])}, stream {gib(b['stream'])}, "
                f"whole GPU {gib(b['gpu'])}. Timed calls: {a['repeats']} at {a['steps']} steps and "
                f"{max(1, a['repeats'] // 2)} at {a['seq_steps']} after one warm-up; sequential offload once at "
                f"{a['seq_steps']} and once at 1 step after a 1-step warm-up, * = scaled to {a['steps']} steps with "
                f"its s/step. Ratios are ours / peer (below 1: faster, smaller).", ""]
        transfer = [f"- {name}: {v.get('seconds', 0):.3f} s, " + (v.get("error") or v.get("note") or
                    ", ".join(f"{p}={s}" for p, s in v["pairs"].items())) for name, v in self.transfers.items()]
        speed = [f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in self.speed.items()]
        head += ["## Speed from a second GPU (replicas; run_many)", "", *speed, ""] if speed else []
        bandwidth = [f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in self.bandwidth.items()]
        head += ["## Host-to-GPU bandwidth (one pinned packed copy of 1 GiB, 3 times)", "", *bandwidth, ""] if (
            bandwidth) else []
        return head + methods_table(self.results) + ["", "## Targets", ""] + targets_table(found) + (
            ["", "## Transfer self-test (pipemap.check_transfers(refresh=True))", ""] + transfer if transfer else [])

    def summary(self, found: list[Target]) -> str:
        parts = [f"device={self.env.get('gpu', self.env['device']).replace(' ', '_')}"]
        for t in found:
            shown = {None: "-", True: "yes", False: "no"}[t.passed] if t.value is None else format(t.value, ".3g")
            parts.append(f"{t.name}={shown}")
        for key, r in self.results.items():
            parts.append(f"{key}_s={secs(r.s_per_image) if r.status == 'ok' else r.status.replace(' ', '_')}")
        if "gpus" in self.transfers:
            parts.append(f"transfer_check_s={self.transfers['gpus'].get('seconds', 0):.3f}")
        for key in ("replicas_speedup", "run_many_speedup", "guidance_speedup", "sequence_speedup"):
            if isinstance(self.speed.get(key), float):
                parts.append(f"{key}={self.speed[key]:.3g}")
        if isinstance(self.bandwidth.get("gb_per_s"), float):
            parts.append(f"h2d_pinned_gbps={self.bandwidth['gb_per_s']:.3g}")
        parts.append(f"offload_budget_gib={gib(self.budgets['offload'])}")
        parts.append(f"stream_budget_gib={gib(self.budgets['stream'])}")
        parts.append(f"total_s={elapsed():.0f}")
        return "summary: " + " ".join(parts)


# ---- main --------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for table.md and results.json")
    p.add_argument("--dry-cpu", action="store_true", help="small pipeline on the CPU; CUDA-only methods skipped")
    p.add_argument("--fake-cuda", action="store_true", help="with --dry-cpu: the CUDA path on the CPU, under the test "
                   "suite's fake CUDA (tests/fakecuda.py, one 'GPU'): pinning, streams, memory caps, every method")
    p.add_argument("--width", type=float, help="channel width factor of the SDXL configs (1 = SDXL; dry: 0.2)")
    p.add_argument("--depth", type=float, help="transformer depth factor (1 = SDXL; dry: 0.2)")
    p.add_argument("--size", type=int, help="image side in pixels (GPU: 512; dry: 128)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of a timed call")
    p.add_argument("--seq-steps", type=int, default=2, help="the second step count (sequential offload's longest)")
    p.add_argument("--repeats", type=int, help="timed calls per method at --steps (GPU: 5; dry: 1)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="GPU: float16; dry: float32")
    p.add_argument("--offload-budget", default="auto", help="balanced_low_memory budget: auto, a fraction of the "
                   "UNet's bytes (1.3) or a size (7GiB)")
    p.add_argument("--stream-budget", default="auto", help="balanced_ultra_low_memory budget: auto (0.6 x UNet), a "
                   "fraction of the UNet's bytes or a size")
    p.add_argument("--method-timeout", type=float, default=60.0, help="seconds one method may take in all "
                   "(twice that for sequential offload)")
    p.add_argument("--no-matched", dest="matched", action="store_false",
                   help="skip ultra_low re-run at the group / sequential offload peaks")
    p.add_argument("--no-speed", dest="speed", action="store_false",
                   help="skip the replicas / run_many measurements (speed_check)")
    p.add_argument("--no-checks", dest="checks", action="store_false",
                   help="skip the lifetime and concurrency checks (del without reset, reset after a call, run_many)")
    p.add_argument("--only", help="comma-separated method key prefixes (plain,pipemap_low,diffusers_group,...)")
    p.add_argument("--time-budget", type=float, default=400.0, help="seconds for the whole run, imports included: "
                   f"each method is capped to what is left less {RESERVE:.0f} s for the sections after the methods "
                   "(each capped in turn), or skipped")
    args = p.parse_args(argv)
    dry = args.dry_cpu
    for name, gpu, cpu in (("width", 1.0, 0.2), ("depth", 1.0, 0.2), ("size", 512, 128), ("repeats", 5, 1),
                           ("dtype", "float16", "float32")):
        if getattr(args, name) is None:
            setattr(args, name, cpu if dry else gpu)
    if args.seq_steps >= args.steps or args.seq_steps < 2:
        p.error("--seq-steps must be at least 2 and below --steps")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fake_cuda:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import fakecuda

        fakecuda.install(gpus=1)
    if not args.dry_cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-cpu to exercise the script on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_cpu and not args.fake_cuda else "cuda:0"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    models = build_models(sdxl_configs(args.width, args.depth), device, getattr(torch, args.dtype))
    print(f"built the pipeline's models on {device} in {time.perf_counter() - start:.1f} s", flush=True)
    gpu_memory = torch.cuda.get_device_properties(device).total_memory if device != "cpu" else 100 * 2**30
    budgets = Budgets.for_pipeline(fresh_pipeline(models), args, gpu_memory)
    report = Report(args.out, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    environment(args, device), asdict(budgets))
    print(f"sizes: {budgets.sizes}\nbudgets: offload {budgets.offload} stream {budgets.stream} gpu {budgets.gpu}")

    def write(results):
        report.results = results
        report.write()

    runner = Runner(args, models, device)
    report.results = run_all(args, runner, budgets, write)
    if args.speed:
        report.speed = capped("speed", args, lambda cap: within(cap, speed_check, args, models, device))
        report.speed.update(capped("branches", args, lambda cap: within(cap, branches_check, args, device)))
        print(f"speed: {report.speed}", flush=True)
    if args.checks:
        report.checks = capped("lifetime", args, lambda cap: lifetime_checks(args, runner, budgets, cap))
    report.bandwidth = capped("bandwidth", args, lambda cap: bandwidth_check(args, device, cap))
    print(f"bandwidth: {report.bandwidth}", flush=True)
    report.write()
    report.transfers = capped("transfers", args, lambda cap: within(cap, transfer_check, device != "cpu"))
    report.doctor = str(capped("doctor", args, doctor))
    print("\n" + report.doctor)
    text = report.write()
    print("\n" + text)
    print(report.summary(targets(report.results, report.checks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
