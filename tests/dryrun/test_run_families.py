"""The dry run on the classes of pipeline code it once failed or raised on (issue 28), each class on two families
built from diffusers' own fast-test components (tests/families.py).

For each: the family saved with ``save_pretrained``; the dry run on two stand-in GPUs is ok from the folder and from
the folder loaded by plain diffusers, with the same peaks. Where the fix changed the real run too (submodules called
directly, argument lists written by a block on another GPU, a folder without a scheduler subfolder), ``pipemap.load``
onto the plan, remapped onto the CPU, gives plain diffusers' output.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_dispatch import attention_backend

import families
import pipemap
from helpers import plain_pipeline
from pipemap.errors import DoesNotFitError

# class -> (family, variant): "flex" runs under diffusers' flex attention backend, "split" on a plan that cuts the
# VAE across GPUs
CLASSES = {
    "deep copy of a stand-in": (("kandinsky22_inpaint", ""), ("skyreels_df", "")),
    "weight_norm module copied": (("stable_audio", ""), ("longcat_audio", "")),
    "attention kernel refusing stand-ins": (("anyflow_far", ""), ("wan_t2v", "flex")),
    "submodule called directly": (("motif_i2v", ""), ("audioldm2", "")),
    "decoded output read as an image": (("visualcloze", ""), ("visualcloze_combined", "")),
    "component class of a pipeline module": (("kolors", ""), ("kandinsky21", "")),
    "random seed read on the host": (("stable_audio", ""), ("sd_sde", "")),
    "split plan in a segment loop": (("wan_animate", "split"), ("wan_v2v", "split")),
}
# the fix changed what a real run does: it must still equal plain diffusers
REAL_RUN = {"submodule called directly", "split plan in a segment loop"}
ON_CPU = {f"cuda:{i}": "cpu" for i in range(8)}


@dataclass(frozen=True)
class Saved:
    folder: str
    call: dict
    plain: object  # the folder loaded by plain diffusers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, Saved] = {}

    def get(name: str) -> Saved:
        if name not in cache:
            pipe, call = families.build(name, tmp_path_factory.mktemp(f"{name}-scratch"))
            folder = tmp_path_factory.mktemp(name)
            pipe.save_pretrained(folder)
            cache[name] = Saved(str(folder), call, plain_pipeline(str(folder)))
        return cache[name]

    return get


def _plan(family: Saved, variant: str) -> pipemap.Plan:
    inventory = pipemap.inspect(family.folder)
    sizes = {c.name: c.bytes for c in inventory.models}
    if variant != "split":  # two GPUs: the largest model fits one, the whole pipeline needs both
        room = max(int(0.6 * sum(sizes.values())), int(1.05 * max(sizes.values())))
        return pipemap.plan(family.folder, hardware=f"2x{room}B,cpu=1GiB", headroom=0.0)
    # the first machine of a few GPUs, from roomy to tight, whose balanced_split plan cuts the VAE between blocks
    for gpus, share in itertools.product((2, 3, 4), (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)):
        hardware = f"{gpus}x{int(share * sum(sizes.values()) / gpus * 1.3)}B,cpu=1GiB"
        try:
            plan = pipemap.plan(inventory, hardware=hardware, strategy="balanced_split", headroom=0.0)
        except DoesNotFitError:
            continue
        if next(p for p in plan.components if p.component == "vae").shards:
            return plan
    raise AssertionError(f"no machine tried cuts the VAE: {sizes}")


def _cases():
    return [pytest.param(kind, name, variant, id=f"{kind}-{name}{'-' + variant if variant else ''}")
            for kind, pair in CLASSES.items() for name, variant in pair]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "name", "variant"), _cases())
def test_dry_run_from_folder_and_pipeline(saved, kind, name, variant):
    family = saved(name)
    plan = _plan(family, variant)
    with attention_backend("flex") if variant == "flex" else contextlib.nullcontext():
        # the peaks only: no tiling advice, whose second dry run has its own test (tests/dryrun/test_trackers.py)
        from_folder = pipemap.simulate(family.folder, plan, advice=False, **families.fresh(family.call))
        from_pipeline = pipemap.simulate(family.plain, plan, advice=False, **families.fresh(family.call))
    assert from_folder.ok, from_folder.error
    assert from_pipeline.ok, from_pipeline.error
    assert from_folder.peak_bytes == from_pipeline.peak_bytes
    if kind in REAL_RUN:
        reference = families.output(family.plain(**families.fresh(family.call)))
        pipe = pipemap.load(family.folder, plan=plan.remap(ON_CPU), progress=False)
        torch.testing.assert_close(families.output(pipe(**families.fresh(family.call))), reference, atol=1e-5, rtol=0)
        pipemap.reset(pipe)


@pytest.mark.slow
def test_folder_without_a_scheduler_subfolder_is_planned_loaded_and_dry_run(saved):
    # LongCat AudioDiT makes its own scheduler: save_pretrained writes no scheduler/, from_pretrained needs none
    family = saved("longcat_audio")
    assert not (pipemap.inspect(family.folder)["scheduler"].bytes)
    plan = _plan(family, "")
    reference = families.output(family.plain(**families.fresh(family.call)))
    pipe = pipemap.load(family.folder, plan=plan.remap(ON_CPU), progress=False)
    torch.testing.assert_close(families.output(pipe(**families.fresh(family.call))), reference, atol=1e-5, rtol=0)
    report = pipemap.simulate(family.folder, plan, **families.fresh(family.call))
    assert report.ok, report.error
