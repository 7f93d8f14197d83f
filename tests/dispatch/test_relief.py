"""relief: an out-of-memory error inside a denoiser call (injected on the CPU) moves the least-used resident
components of that device to the host, the call is retried and the outputs equal plain diffusers'; the move is in
the plan's notes; and a move that fails part-way leaves the pipeline as it was."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pipemap
from pipemap import tiny
from pipemap.api import memory_for
from pipemap.dispatch import planned
from pipemap.dispatch.relief import offloaded, replace_placements
from pipemap.hooks import OffloadHook, PlacementHook

ONE_GPU = "cuda:0=8MiB,cpu=1GiB"  # every component of the tiny SD on cuda:0


def _calls(n: int) -> list[dict]:
    return [dict(prompt=f"a tiny cat number {i}", num_inference_steps=2, height=32, width=32,
                 generator=torch.Generator().manual_seed(i), output_type="np") for i in range(n)]


def _leaf(module: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in module.modules() if m is not module and not list(m.children()))


@pytest.mark.slow
def test_out_of_memory_in_the_denoiser_moves_the_least_used_to_the_host_and_retries():
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    plain = [torch.as_tensor(pipe(**call).images) for call in _calls(3)]
    plan = pipemap.plan(pipe, hardware=ONE_GPU, headroom=0.0)
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu"}))
    admission = memory_for(pipe, plan)  # before the injection: the dry runs copy the pipeline as it is now
    failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 MiB. GPU 0 has a total "
                                       "capacity of 8.00 MiB of which 1.00 MiB is free.")]
    unet_calls = []

    def first_call_fails(module, args):
        unet_calls.append(1)
        if failures:
            raise failures.pop()

    handle = _leaf(pipe.unet).register_forward_pre_hook(first_call_fails)
    try:
        outputs = pipemap.run_many(pipe, _calls(3), workers=2, plan=plan)
    finally:
        handle.remove()
    for got, want in zip(outputs, plain, strict=True):
        torch.testing.assert_close(torch.as_tensor(got.images), want, atol=0, rtol=0)
    assert len(unet_calls) == 3 * 2 + 1  # the failed call, run once more
    (relief,) = admission.moves
    # at the first unet call the vae had never run and the text encoder twice: the vae leaves, 2.5 MiB freed
    assert relief.component == "unet" and relief.device == "cuda:0" and relief.moved == ("vae",)
    assert isinstance(pipe.vae._hf_hook, OffloadHook) and isinstance(pipe.unet._hf_hook, PlacementHook)
    running = planned(pipe)
    assert running is admission.running and running.placement("vae").mode == "offload" and relief.note in running.notes
    assert admission.plan.placement("vae").execution_device == "cuda:0" and relief.note in admission.plan.notes
    assert pipemap.stats(pipe)["vae"]["h2d_bytes"] == 3 * plan.placement("vae").bytes  # onloaded at each call
    pipemap.reset(pipe)
    assert pipe.vae.device.type == "cpu" and not hasattr(pipe.vae, "_hf_hook")


@pytest.mark.slow
def test_out_of_memory_with_nothing_left_to_move_fails_the_call():
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    plan = pipemap.plan(pipe, hardware="cuda:0=5MiB,cuda:1=4MiB,cpu=1GiB", headroom=0.0,
                        strategy={"unet": "cuda:0", "text_encoder": "cuda:1", "vae": "cuda:1"})
    assert [p.component for p in plan.components if p.device == "cuda:0"] == ["unet"]
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
    admission = memory_for(pipe, plan)
    handle = _leaf(pipe.unet).register_forward_pre_hook(
        lambda m, a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory.")))
    try:
        (result,) = pipemap.run_many(pipe, _calls(1), plan=plan, return_exceptions=True)
    finally:
        handle.remove()
    assert isinstance(result, torch.OutOfMemoryError) and admission.moves == []
    assert admission.ledger.held() == {d: 0 for d in admission.ledger.memory}  # the failed request released all
    pipemap.reset(pipe)


def test_a_move_that_fails_part_way_leaves_the_pipeline_as_it_was():
    pipe = tiny.build("sd")
    plan = pipemap.plan(pipe, hardware="cpu=1GiB")
    pipemap.dispatch(pipe, plan)
    hooks = {name: getattr(pipe, name)._hf_hook for name in ("text_encoder", "vae")}
    weights = {name: getattr(pipe, name).state_dict() for name in hooks}
    # the vae is moved first; the text encoder's placement names a GPU this machine lacks, so its move fails
    moved = offloaded(plan, ("text_encoder", "vae"), "a test")
    broken = replace(moved, components=tuple(replace(p, device="cuda:7") if p.component == "text_encoder" else p
                                             for p in moved.components))
    with pytest.raises(pipemap.DispatchError) as err:
        replace_placements(pipe, broken, ("vae", "text_encoder"))
    assert err.value.component == "text_encoder"
    for name, hook in hooks.items():
        assert getattr(pipe, name)._hf_hook is hook  # the old hooks are back
        for key, tensor in getattr(pipe, name).state_dict().items():
            assert tensor.device.type == "cpu" and torch.equal(tensor, weights[name][key])
    assert planned(pipe) is plan
    assert pipe(**_calls(1)[0]).images.shape == (1, 32, 32, 3)
    pipemap.reset(pipe)


# ---- the host held to its budget ---------------------------------------------------------------------------------


def _failure(tried: int = 3 * 2**19):
    from pipemap.runtime.admission import OutOfMemory

    return OutOfMemory("unet", "cuda:0", tried, 0, "CUDA out of memory. Tried to allocate 1.50 MiB.")


def test_only_what_fits_in_the_cpu_budget_moves_to_the_host():
    from pipemap.dispatch.relief import least_used, refused

    pipe = tiny.build("sd")
    # the tiny SD's vae is 2.5 MiB, its text encoder 223 KiB: a CPU budget of 1 MiB has room for the encoder only
    plan = pipemap.plan(pipe, hardware="cuda:0=8MiB,cpu=1MiB", headroom=0.0)
    assert least_used(plan, _failure(), {"vae": {"calls": 0}, "text_encoder": {"calls": 2}}) == ("text_encoder",)
    unbounded = replace(plan, devices=tuple(d for d in plan.devices if d.device != "cpu"))
    assert least_used(unbounded, _failure(), {"vae": {"calls": 0}, "text_encoder": {"calls": 2}}) == ("vae",)
    tight = pipemap.plan(pipe, hardware="cuda:0=8MiB,cpu=64KiB", headroom=0.0)
    assert least_used(tight, _failure(), {}) == ()
    refusal = refused(tight, _failure())
    assert refusal is not None and refusal.moved == () and refusal.plan is tight
    assert "'text_encoder' (223.00 KiB), does not fit in the 64.00 KiB the CPU budget has left" in refusal.note


@pytest.mark.slow
def test_out_of_memory_with_no_host_room_fails_the_call_with_the_figures():
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    plan = pipemap.plan(pipe, hardware="cuda:0=8MiB,cpu=64KiB", headroom=0.0)
    pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu"}))
    admission = memory_for(pipe, plan)
    failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 MiB. GPU 0 has a total "
                                       "capacity of 8.00 MiB of which 1.00 MiB is free.")]
    handle = _leaf(pipe.unet).register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(failures.pop())
                                                        if failures else None)
    try:
        (result,) = pipemap.run_many(pipe, _calls(1), plan=plan, return_exceptions=True)
    finally:
        handle.remove()
    assert isinstance(result, torch.OutOfMemoryError) and admission.moves == []
    assert any("the CPU budget has left" in note for note in result.__notes__)
    assert not any(isinstance(getattr(pipe, n)._hf_hook, OffloadHook) for n in ("vae", "text_encoder"))
    assert planned(pipe).placement("vae").mode == "resident"
    pipemap.reset(pipe)
