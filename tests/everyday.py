"""What the everyday-diffusers tests share (``tests/test_everyday_*.py``): tiny pipelines placed on two GPUs under
each strategy and remapped onto the CPU, LoRAs and IP-Adapters built in code, and the check that every tensor of
every component lives where its placement says."""

from __future__ import annotations

import dataclasses

import torch

import pipemap
from helpers import models_of, moving
from pipemap import tiny
from pipemap.dispatch import planned
from pipemap.hooks import ReplicaHook
from pipemap.hooks.changes import groups, signature
from pipemap.hooks.moving import MovingHook
from pipemap.inventory import DENOISERS
from pipemap.quantized import storage

STRATEGIES = ("balanced", "balanced_low_memory", "balanced_ultra_low_memory", "parallel")
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


def two_gpu_plan(pipe, strategy: str) -> pipemap.Plan:
    """``pipe`` planned on two GPUs with room for everything under ``strategy``; for the low-memory strategies the
    balanced plan with the denoiser and the text encoders moved as those strategies move what does not fit
    (offloaded whole, or streamed as finely as the planner cuts), the denoiser on cuda:0, the encoders on cuda:1."""
    inventory = pipemap.inspect(pipe)
    total = sum(c.bytes for c in inventory.models)
    hardware = f"2x{2 * total},cpu=1GiB"
    if strategy in ("balanced", "parallel"):
        return pipemap.plan(pipe, hardware=hardware, strategy=strategy, headroom=0.0)
    base = pipemap.plan(pipe, hardware=hardware, strategy="balanced", headroom=0.0)
    mode = "offload" if strategy == "balanced_low_memory" else "stream"
    names = [c.name for c in inventory.models if c.name in DENOISERS or c.name.startswith("text_encoder")]
    moved = moving(base, inventory, {n: (mode, "cuda:0" if n in DENOISERS else "cuda:1") for n in names})
    return dataclasses.replace(moved, strategy=strategy)


def placed(kind: str, strategy: str):
    """A tiny ``kind`` pipeline dispatched on its two-GPU plan for ``strategy``, remapped onto the CPU."""
    pipe = tiny.build(kind)
    pipe.set_progress_bar_config(disable=True)
    plan = two_gpu_plan(pipe, strategy)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    return pipe, plan


def plain(kind: str):
    pipe = tiny.build(kind)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(pipe, kind: str, **extra) -> torch.Tensor:
    return torch.as_tensor(pipe(**{**tiny.default_call(pipe, kind), **extra}).images)


def strays(pipe) -> list[str]:
    """Every tensor of every component that is not where its placement keeps it (empty when all are): each model as
    pipemap last placed it (nothing changed since, unfollowed); a resident component's tensors on its device; an
    offloaded or streamed one's in one of its hook's groups, their masters in CPU RAM; a replicated one's copies
    holding the same tensors (values, and modules' state) as the home copy."""
    plan = planned(pipe)
    found = []
    for name, module in models_of(pipe).items():
        p = plan.placement(name)
        hook = module._hf_hook
        if getattr(module.__dict__.get("_pipemap_seen"), "signature", None) != signature(module):
            found.append(f"{name}: changed since pipemap last placed it")
        tensors = {id(t): (path, t) for path, t in _tensors(module)}
        if isinstance(hook, MovingHook):
            grouped = {id(s.get()) for g in groups(hook) for s in g.slots}
            found += [f"{name}.{path}: in no group" for key, (path, _) in tensors.items() if key not in grouped]
            found += [f"{name}.{path}: master not in CPU RAM" for g in groups(hook) for s in g.slots
                      for path in [s.owners[0][1]] if (s.master if g.loaded else s.get()).device.type != "cpu"]
        else:
            shard_of = {path: device for path, device, _ in p.shards}
            for path, tensor in tensors.values():
                want = next((d for s, d in shard_of.items() if path.startswith(s + ".")), p.device)
                if tensor.device != torch.device(want):
                    found.append(f"{name}.{path}: on {tensor.device}, placed on {want}")
        if isinstance(hook, ReplicaHook):
            found += [f"{name} replica: {problem}" for r in hook.replicas for problem in _differences(module, r)]
    return found


def _tensors(module: torch.nn.Module):
    seen = set()
    for path, sub in module.named_modules():
        for store in ("_parameters", "_buffers"):
            for key, tensor in getattr(sub, store).items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    yield f"{path}.{key}".lstrip("."), tensor


def _differences(home: torch.nn.Module, copy: torch.nn.Module) -> list[str]:
    mine, theirs = dict(_tensors(home)), dict(_tensors(copy))
    if mine.keys() != theirs.keys():
        return [f"tensors differ: {sorted(mine.keys() ^ theirs.keys())[:3]}"]
    return [path for path in mine if not all(torch.equal(a.detach().cpu(), b.detach().cpu()) for a, b in
                                             zip(storage(mine[path]), storage(theirs[path]), strict=True))]


# ---- adapters built in code --------------------------------------------------------------------------------------


def save_lora(kind: str, folder, seed: int, targets=("to_q", "to_k", "to_v", "to_out.0"), rank: int = 4) -> str:
    """A LoRA of the tiny ``kind`` pipeline's denoiser, random (not the zero init), saved as diffusers saves one;
    returns the folder."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = plain(kind)
    denoiser = pipe.transformer if kind == "flux" else pipe.unet
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False))
    layers = get_peft_model_state_dict(denoiser)
    prefix = "transformer" if kind == "flux" else "unet"
    type(pipe).save_lora_weights(str(folder), **{f"{prefix}_lora_layers": layers}, safe_serialization=True)
    return str(folder)


def save_ip_adapter(pipe, folder, seed: int = 3, tokens: int = 4) -> str:
    """IP-Adapter weights for the tiny SD ``pipe`` (image projection, a key and value projection per cross-attention
    processor, numbered as diffusers numbers them) and a tiny CLIP image encoder in ``folder/image_encoder``."""
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    unet, embed = pipe.unet, 16
    cross = unet.config.cross_attention_dim
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"image_proj.proj.weight": rand(cross * tokens, embed), "image_proj.proj.bias": rand(cross * tokens),
               "image_proj.norm.weight": torch.ones(cross), "image_proj.norm.bias": torch.zeros(cross)}
    key = 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        hidden = unet.get_submodule(name.removesuffix(".processor")).to_k.out_features
        weights[f"ip_adapter.{key}.to_k_ip.weight"] = rand(hidden, cross)
        weights[f"ip_adapter.{key}.to_v_ip.weight"] = rand(hidden, cross)
        key += 2
    save_file(weights, f"{folder}/ip_adapter.safetensors")
    config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=2,
                              image_size=32, patch_size=8, projection_dim=embed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        CLIPVisionModelWithProjection(config).eval().save_pretrained(f"{folder}/image_encoder")
    return str(folder)


def load_ip_adapter(pipe, folder) -> None:
    pipe.load_ip_adapter(folder, subfolder="", weight_name="ip_adapter.safetensors",
                         image_encoder_folder="image_encoder")


def ip_image():
    from PIL import Image

    pixels = torch.Generator().manual_seed(5)
    return Image.fromarray((torch.rand(32, 32, 3, generator=pixels) * 255).to(torch.uint8).numpy())


# ---- quantized components ------------------------------------------------------------------------------------------


def quantize(module: torch.nn.Module, library: str) -> torch.nn.Module:
    """``module``'s linear layers in int8 (weights only) by ``library``: ``"quanto"`` or ``"torchao"``."""
    if library == "quanto":
        from optimum.quanto import freeze, qint8
        from optimum.quanto import quantize as quanto_quantize

        quanto_quantize(module, weights=qint8)
        freeze(module)
    else:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(module, Int8WeightOnlyConfig())
    return module
