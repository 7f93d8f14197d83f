"""Print the README's table: each catalog pipeline's "auto" plan at its published dtype on three machines, with the
cost model's predicted seconds per image (at the pipeline's own default call: steps, guidance, resolution, frames,
priced from the work the catalog's record counted for it) and the layout, and a column of speed from two GPUs
(``SPEED_MACHINE``). No download: sizes come from the catalog's published configs.

    python bench/catalog_plans.py            # markdown table on stdout
"""

from __future__ import annotations

import pipemap
from pipemap import catalog
from pipemap.cost import (
    TRUE_CFG,
    bytes_moved,
    formula_counts,
    images_per_second,
    seconds_per_image,
    workload_for,
)
from pipemap.units import format_bytes

MACHINES = ("1x24GiB,cpu=64GiB", "2x16GiB,cpu=64GiB", "1x80GiB,cpu=128GiB")
SPEED_MACHINE = "2x80GiB,cpu=128GiB"  # room for a copy of every catalog denoiser on each GPU
HOW = {"replicated": "replicas", "guidance": "guidance branches at once", "sequence": "tokens split"}
SHORT = {"text_encoder": "te", "text_encoder_2": "te2", "text_encoder_3": "te3", "transformer": "dit",
         "unet": "unet", "vae": "vae", "safety_checker": "safety"}


def layout(plan: pipemap.Plan) -> str:
    """A compact layout: ``dit split cuda:0+1; te2 stream->0; vae 1``."""
    parts = []
    for p in plan.components:
        name = SHORT.get(p.component, p.component)
        gpu = p.execution_device.removeprefix("cuda:")
        if p.mode == "resident":
            parts.append(f"{name} {gpu}")
        elif p.mode == "replicated":
            parts.append(f"{name} x{1 + len(p.replicas)}")
        elif p.mode in ("guidance", "sequence"):
            gpus = "+".join(d.removeprefix("cuda:") for d in (p.device, *p.replicas))
            parts.append(f"{name} {'cfg' if p.mode == 'guidance' else 'seq'} {gpus}")
        elif p.mode == "split":
            away = sorted({d.removeprefix("cuda:") for _, d, _ in p.shards})
            parts.append(f"{name} split {'+'.join([gpu, *away])}")
        elif p.mode == "stream" and p.resident_bytes:
            share = round(100 * p.resident_bytes / p.bytes)
            parts.append(f"{name} stream->{gpu} ({share}% resident)")
        else:
            parts.append(f"{name} {p.mode}->{gpu}")
    return "; ".join(parts)


def row(name: str, machine: str) -> str:
    inventory = pipemap.inspect(name)
    hardware = pipemap.Hardware.parse(machine)
    try:
        plan = pipemap.plan(name, hardware=hardware, strategy="auto")
    except pipemap.DoesNotFitError as err:
        return f"does not fit ({err.component})"
    seconds = seconds_per_image(plan, inventory, hardware.performance, counts=catalog.recorded_counts(name))
    return f"{seconds:.0f} s: {layout(plan)}"


def default_call(name: str) -> str:
    """The default call in words: size, steps, and what the denoiser does a step as the dry run counted it."""
    inventory, counts = pipemap.inspect(name), catalog.recorded_counts(name)
    work = workload_for(inventory)
    denoiser = next(c for c in counts.components if c.component in ("transformer", "unet"))
    calls = round(denoiser.calls_per_step)
    if not work.guidance:
        why = "true CFG only with a negative prompt" if TRUE_CFG.get(inventory.pipeline_class, 1.0) > 1.0 \
            else "guidance-distilled"
        how = f"{why}: {calls} call a step"
    else:
        how = "true CFG, 2 calls a step" if calls == 2 else "CFG as a batch of 2, 1 call a step"
    frames = f"x{work.frames} frames" if work.frames > 1 else ""
    return f"{work.width}x{work.height}{frames}, {counts.steps} steps, {how}"


def speed(name: str, machine: str = SPEED_MACHINE, call: dict | None = None) -> str:
    """Two GPUs as the cost model sees them: seconds per image of one request against the 1-GPU plan of the same
    GPU, and images per second with requests overlapped (``pipemap.run_many``), for the "auto" plan. With ``call``
    (a negative prompt for true CFG) both plans are priced at that call, by the formula (the record counts the
    default call), and "auto" plans for that call (``call=``)."""
    inventory = pipemap.inspect(name)
    counts = None if call else catalog.recorded_counts(name)
    work = workload_for(inventory, call)
    two = pipemap.Hardware.parse(machine)
    one = pipemap.Hardware.parse(machine.replace("2x", "1x", 1))
    figures = {}
    for label, hardware in (("one", one), ("two", two)):
        plan = pipemap.plan(name, hardware=hardware, strategy="auto", call=call)  # "auto" planned for that call
        figures[label] = (seconds_per_image(plan, inventory, hardware.performance, work, counts=counts),
                          images_per_second(plan, inventory, hardware.performance, work, counts=counts), plan)
    (s1, r1, _), (s2, r2, plan) = figures["one"], figures["two"]
    copied = [p for p in plan.components if p.mode in HOW]
    if copied:
        steps = work.steps
        moved = bytes_moved(plan, inventory, work)[copied[0].component]
        how = (f"{HOW[copied[0].mode]}, {format_bytes(round(moved / steps))} a step between GPUs, host "
               f"{host_seconds(inventory, work, counts, copied[0], two):.2g} s")
    else:
        how = "one GPU's work"
    return f"{s2:.0f} s ({s1 / s2:.2f}x, {how}); {r2 * 60:.2g}/min overlapped ({r2 / r1:.2f}x)"


def host_seconds(inventory, work, counts, placement: pipemap.Placement, hardware) -> float:
    """The host's seconds launching a shared denoiser's kernels for one image on each GPU: a part of a batch or of
    the tokens runs every kernel, so this does not shrink with a second GPU (``cost.shared_compute``); guidance
    branches at once run half the calls on each."""
    found = (counts or formula_counts(inventory, work))[placement.component]
    steps = counts.iterations(work.steps) if counts is not None else work.steps
    kernels = found.total(steps).kernels / (2 if placement.mode == "guidance" else 1)
    return kernels * hardware.performance.kernel_seconds


def main() -> None:
    header = ["pipeline", "default call", *(m.split(",")[0] for m in MACHINES), f"{SPEED_MACHINE.split(',')[0]} speed"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in catalog.names():
        print("| " + " | ".join([name, default_call(name), *(row(name, m) for m in MACHINES), speed(name)]) + " |")
        if TRUE_CFG.get(pipemap.inspect(name).pipeline_class, 1.0) > 1.0:
            cfg = {"negative_prompt": " ", "true_cfg_scale": TRUE_CFG[pipemap.inspect(name).pipeline_class]}
            print(f"| {name}, with a negative prompt | true CFG, 2 calls a step | | | | {speed(name, call=cfg)} |")


if __name__ == "__main__":
    main()
