"""An offloaded VAE that the pipeline upcasts for each decode (SDXL with force_upcast: ``vae.to(float32)`` before
decode, ``vae.to(float16)`` after) while it stays onloaded in its LRU cache: the conversion must not leave the
converted weights on the GPU beside the buffer the plan counted. Under the fake CUDA (tests/fakecuda.py), whose
allocator counts every byte on each fake GPU; bfloat16 stands in for float16 (CPU convolutions).

Run from the project root: PYTHONPATH=src:tests .venv/bin/python bench/repros/vae_upcast_repin.py
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL

import fakecuda

fake = fakecuda.install()

from pipemap.hooks import HOOKS, Ledger, hook_component  # noqa: E402
from pipemap.plan import Placement  # noqa: E402

torch.manual_seed(0)
vae = AutoencoderKL(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32).eval()
vae = vae.to(torch.bfloat16)
fp32 = sum(p.numel() * 4 for p in vae.parameters())
hook = HOOKS["offload"](Placement("vae", "cpu", 1, "offload", "cuda:0", 10**9), "cuda:0", Ledger())
hook_component(vae, hook)
z = torch.randn(1, 4, 8, 8).to("cuda:0")
with torch.no_grad():
    vae.decode(z.to(torch.bfloat16))  # onloaded, and left in its cache
at_decode = []
vae.decoder.register_forward_pre_hook(lambda m, a: at_decode.append(
    (fake.allocated[0] - z.numel() * 4, hook.ledger.live["cuda:0"])))
worst = 0
for image in range(3):
    before = len(fake.register_log)
    vae.to(torch.float32)  # what the SDXL pipeline's upcast_vae() does for each image
    with torch.no_grad():
        vae.decode(z)
    vae.to(torch.bfloat16)  # cast back after decode
    log = fake.register_log[before:]
    held, counted = at_decode[-1]
    beyond = held - counted  # on the GPU when decode starts, beyond what the ledger (the plan's room) counts
    after = fake.allocated[0] - z.numel() * 4
    worst = max(worst, beyond, after - hook.ledger.live["cuda:0"])
    print(f"image {image}: {sum(op == 'register' for op, _, _ in log)} register, "
          f"{sum(op == 'unregister' for op, _, _ in log)} unregister | GPU at decode {held} B (float32 VAE {fp32} B), "
          f"ledger {counted} B | after the cast back: GPU {after} B, ledger {hook.ledger.live['cuda:0']} B")
fake.exit()
raise SystemExit(0 if worst <= 16 * 1024 else 1)  # rounding, and post_quant_conv's output before the decoder
