"""How the cost model prices guidance branches at once and a sequence split (``pipemap.cost``: ``guidance_cost``,
``sequence_cost``), and what ``"auto"`` makes of them for the published pipelines on two GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pipemap
from pipemap import Component, Hardware, Inventory, Placement
from pipemap.cost import (
    COLLECTIVE_LATENCY,
    EXCHANGE_ITEM_BYTES,
    EXCHANGE_LATENCY,
    EXCHANGE_LAUNCHES,
    PERMUTE_SHARE,
    PROMPT_BYTES,
    RANK_LATENCY,
    REPLICA_BYTES_PER_TOKEN,
    STRAGGLER_WAIT,
    THREAD_EXCHANGE_SECONDS,
    Workload,
    bytes_moved,
    component_cost,
    device_seconds,
    exchanged_per_call,
    moved_per_image,
    seconds_per_image,
)
from pipemap.hardware import Performance

GIB = 2**30
PERF = Performance(flops=100e12, peer_bandwidth=20e9)
# a 10 GiB transformer in bf16 whose self-attention layers are 3072 wide, 20 of them
TRANSFORMER = Component("transformer", "diffusers", "FluxTransformer2DModel", 10 * GIB, True,
                        blocks=tuple((f"blocks.{i}", GIB // 2) for i in range(20)), attention_width=20 * 3072)
CFG = Workload(1024, 1024, 10, True, text_tokens=512)  # 10 steps, two calls each: 4096 + 512 tokens a call


def _cost(mode: str, work: Workload, copies: int = 1):
    placement = Placement("transformer", "cuda:0", TRANSFORMER.bytes, mode,
                          replicas=tuple(f"cuda:{i}" for i in range(1, 1 + copies)))
    return component_cost(placement, TRANSFORMER, 2, PERF, work), placement


def test_guidance_hides_one_call_of_every_step_but_the_first():
    plain, _ = _cost("resident", CFG)
    cost, placement = _cost("guidance", CFG)
    per_call = plain.compute / CFG.calls
    assert cost.compute == pytest.approx(plain.compute - (CFG.steps - 1) * per_call)  # 11 calls' time, not 20
    moved = (CFG.steps - 1) * CFG.latent_tokens * REPLICA_BYTES_PER_TOKEN + PROMPT_BYTES
    assert moved_per_image(placement, TRANSFORMER, CFG) == moved  # latents there and back; the prompt once
    assert cost.transfer == pytest.approx(moved / PERF.peer_bandwidth)
    assert cost.compute + cost.transfer < cost.total < cost.compute + cost.transfer + 0.01  # the checks: small
    distilled = Workload(1024, 1024, 10, False, text_tokens=512)  # one call a step: nothing to run at once
    assert _cost("guidance", distilled)[0].total == _cost("resident", distilled)[0].total
    busy = device_seconds(pipemap.Plan("parallel", (placement,), (), "cuda:0", "bfloat16"),
                          Inventory("t", "WanPipeline", (TRANSFORMER,), "bfloat16"), PERF, CFG)
    assert busy["cuda:1"] == pytest.approx(cost.compute + cost.transfer) and busy["cuda:0"] == cost.total


@pytest.mark.parametrize("gpus", [2, 4])
def test_a_sequence_split_shares_the_compute_and_pays_the_exchanges(gpus):
    plain, _ = _cost("resident", CFG)
    cost, placement = _cost("sequence", CFG, copies=gpus - 1)
    # each its share, and beyond two ranks a wait for late peers at each of the 10 x 2 calls' 20 x 4 exchanges
    assert cost.compute == pytest.approx(plain.compute / gpus + 20 * 20 * 4 * STRAGGLER_WAIT * (gpus - 2))
    tokens = CFG.latent_tokens + CFG.text_tokens
    # each GPU sends its share of queries, keys, values and outputs at each of the 20 layers, keeping 1/gpus of it
    sent = 4 * tokens / gpus * 20 * 3072 * EXCHANGE_ITEM_BYTES * (gpus - 1) / gpus
    assert exchanged_per_call(TRANSFORMER, CFG, gpus) == pytest.approx(sent)
    assert moved_per_image(placement, TRANSFORMER, CFG) > CFG.calls * gpus * sent  # and the inputs to the copies
    assert plain.total / gpus < cost.total < plain.total  # a win, short of the full share: the exchanges show


# catalog pipelines in bf16: one 80 GiB GPU against two, "auto", at each pipeline's own default call
@pytest.mark.parametrize(("name", "mode", "least"), [
    # guidance-distilled: one call a step, its tokens split (over the generic 20 GB/s link, with the permute copies
    # around each exchange priced: 1.53x)
    ("flux.1-dev", "sequence", 1.5),
    # true CFG runs two calls a step only with a negative prompt: its default call is one, its tokens split
    ("qwen-image", "sequence", 1.5),
    ("wan2.1-t2v-14b", "guidance", 1.8),
])
def test_auto_on_two_gpus_splits_the_published_transformers(name, mode, least):
    inventory = pipemap.inspect(name, dtype=torch.bfloat16)
    one, two = Hardware.parse("1x80GiB,cpu=128GiB"), Hardware.parse("2x80GiB,cpu=128GiB")
    # the published runs' ranks are processes, each launching in its own interpreter
    plans = {hw: pipemap.plan(inventory, hardware=hw, strategy="auto", ranks="process") for hw in (one, two)}
    transformer = plans[two].placement("transformer")
    assert (transformer.mode, transformer.device, transformer.replicas) == (mode, "cuda:0", ("cuda:1",))
    speedup = (seconds_per_image(plans[one], inventory, one.performance)
               / seconds_per_image(plans[two], inventory, two.performance))
    assert speedup >= least
    assert "auto: parallel is the fastest plan" in plans[two].notes[-1]
    assert any(n.startswith("parallel: transformer") for n in plans[two].explain().splitlines())
    assert bytes_moved(plans[two], inventory)["transformer"] > 0  # what the GPUs exchange, priced and shown
    link = plans[two].picture(bytes_moved(plans[two], inventory)).links
    assert [(lk.source, lk.target) for lk in link] == [("cuda:0", "cuda:1")]


@pytest.mark.parametrize("mode", ["sequence", "replicated"])
def test_a_split_call_shares_the_gpus_work_but_not_the_hosts_launches(mode):
    # the same transformer on a GPU 1000x faster: its launches (4.7 a module, 10 modules a block without a module
    # tree, 40.2 us each) outlast its work, and each GPU launches every kernel of its share: two GPUs gain nothing
    fast = Performance(flops=100e15, memory_bandwidth=600e12, peer_bandwidth=20e9)
    placement = Placement("transformer", "cuda:0", TRANSFORMER.bytes, mode, replicas=("cuda:1",))
    plain = component_cost(Placement("transformer", "cuda:0", TRANSFORMER.bytes), TRANSFORMER, 2, fast, CFG)
    split = component_cost(placement, TRANSFORMER, 2, fast, CFG)
    assert plain.compute == pytest.approx(CFG.calls * 4.7 * 20 * 10 * fast.kernel_seconds)
    # a sequence split's ranks also launch each exchange's own kernels: the permute copies and the collective
    exchanges = CFG.calls * 20 * 4 * EXCHANGE_LAUNCHES * fast.kernel_seconds if mode == "sequence" else 0.0
    assert split.compute == pytest.approx(plain.compute + exchanges) and split.total > plain.total
    # a batch cut across copies meets once a call (gathered, inputs broadcast): priced beside the bytes
    if mode == "replicated":
        assert split.transfer == pytest.approx(moved_per_image(placement, TRANSFORMER, CFG) / fast.peer_bandwidth
                                               + CFG.calls * COLLECTIVE_LATENCY)


def test_a_sequence_split_prices_each_collective_and_the_input_broadcast_exactly():
    # a made-up transformer: 4 attention layers 1024 wide, on a 1024 x 1024 call of one step without guidance
    # (4096 latent tokens: 16 pixels a side each; 512 text tokens), split over two GPUs joined at 20 GB/s
    small = Component("transformer", "diffusers", "FluxTransformer2DModel", 4 * GIB, True,
                      blocks=tuple((f"blocks.{i}", GIB) for i in range(4)), attention_width=1024)
    work = Workload(1024, 1024, 1, False, text_tokens=512)
    placement = Placement("transformer", "cuda:0", small.bytes, "sequence", replicas=("cuda:1",))
    tokens = 4096 + 512
    sent = 4 * tokens / 2 * 1024 * 2 * 1 / 2  # q, k, v, out of its half, less the quarter it keeps
    inputs = 4096 * REPLICA_BYTES_PER_TOKEN // 2 + PROMPT_BYTES  # the latents in and the prompt, to the other rank
    moved = 2 * sent + inputs
    assert moved_per_image(placement, small, work) == pytest.approx(moved)
    cost = component_cost(placement, small, 2, PERF, work)
    # the link carries one GPU's share at a time; 4 all-to-alls a layer, the broadcast and the gather a call
    # and the permute copies around each exchange, PERMUTE_SHARE of the exchange's time (its bytes over the link)
    permutes = 2 * sent / 2 / 20e9 * PERMUTE_SHARE / (1 - PERMUTE_SHARE)
    assert cost.transfer == pytest.approx(moved / 2 / 20e9 + permutes + 4 * 4 * EXCHANGE_LATENCY
                                          + 2 * COLLECTIVE_LATENCY)
    assert cost.transfer == pytest.approx(moved / 4e10 + sent / 20e9 * 0.38 / 0.62 + 16 * 50e-6 + 2 * 50e-6)
    # over 8 ranks each collective waits for 6 more peers (RANK_LATENCY each): latency that grows with the ranks
    eight = replace(placement, replicas=tuple(f"cuda:{i}" for i in range(1, 8)))
    latency = component_cost(eight, small, 2, replace(PERF, peer_bandwidth=1e30), work).transfer
    assert latency == pytest.approx(16 * (EXCHANGE_LATENCY + 6 * RANK_LATENCY) + 2 * (COLLECTIVE_LATENCY
                                                                                      + 6 * RANK_LATENCY))


def test_the_slowest_of_more_ranks_sets_a_gpu_bound_splits_pace():
    # a GPU-bound split (the generic GPU, slow beside its host): each rank's GPU work is its share, and beyond two
    # ranks each collective waits for late peers, STRAGGLER_WAIT a collective and rank (fitted on vLLM-Omni's 8
    # H800s): a wait per collective, so a long sequence's calls, with more work between two collectives, notice it
    # less (Wan 2.1's and HunyuanVideo's 8-GPU runs, which a share of the work per rank priced at 1.45x)
    video = Workload(720, 1280, 10, True, frames=81)  # 75,600 tokens a call

    def compute(gpus: int, work: Workload) -> float:
        placement = Placement("transformer", "cuda:0", TRANSFORMER.bytes, "sequence",
                              replicas=tuple(f"cuda:{i}" for i in range(1, gpus)))
        return component_cost(placement, TRANSFORMER, 2, PERF, work).compute

    def plain(work: Workload) -> float:
        return component_cost(Placement("transformer", "cuda:0", TRANSFORMER.bytes), TRANSFORMER, 2, PERF,
                              work).compute

    assert compute(2, CFG) == pytest.approx(plain(CFG) / 2)
    assert compute(8, CFG) == pytest.approx(plain(CFG) / 8 + 20 * 20 * 4 * 6 * STRAGGLER_WAIT)
    assert compute(8, video) - plain(video) / 8 == pytest.approx(compute(8, CFG) - plain(CFG) / 8)
    assert compute(8, video) / (plain(video) / 8) < 1.05 < compute(8, CFG) / (plain(CFG) / 8)


def test_threads_launch_one_rank_after_the_other_and_meet_at_a_barrier_each_exchange():
    # the same split with its ranks as threads of one process (ranks="thread"): one interpreter launches both
    # ranks' kernels, and each exchange is a barrier pair (202 us measured) instead of an NCCL collective
    small = Component("transformer", "diffusers", "FluxTransformer2DModel", 4 * GIB, True,
                      blocks=tuple((f"blocks.{i}", GIB) for i in range(4)), attention_width=1024)
    work = Workload(1024, 1024, 1, False, text_tokens=512)
    fast = Performance(flops=100e15, memory_bandwidth=600e12, peer_bandwidth=1e30)  # launch-bound
    placement = Placement("transformer", "cuda:0", small.bytes, "sequence", replicas=("cuda:1",))
    process = component_cost(placement, small, 2, fast, work, ranks="process")
    thread = component_cost(placement, small, 2, fast, work, ranks="thread")
    assert thread.compute == pytest.approx(2 * process.compute)  # every launch of both ranks, one at a time
    assert thread.transfer - process.transfer == pytest.approx(16 * (THREAD_EXCHANGE_SECONDS - EXCHANGE_LATENCY))
    assert component_cost(placement, small, 2, fast, work) == process  # no runtime named: processes
    # guidance branches as threads: the second call of a step hides behind the first only as far as the one
    # interpreter can launch both, so a launch-bound pair gains nothing
    branches = Placement("transformer", "cuda:0", small.bytes, "guidance", replicas=("cuda:1",))
    plain = component_cost(Placement("transformer", "cuda:0", small.bytes), small, 2, fast, CFG)
    assert component_cost(branches, small, 2, fast, CFG, ranks="process").compute < 0.6 * plain.compute
    assert component_cost(branches, small, 2, fast, CFG, ranks="thread").compute == pytest.approx(plain.compute)


@pytest.mark.parametrize("name", ["flux.1-dev", "stable-diffusion-1.5"])
def test_auto_splits_no_call_across_gpus_when_the_host_sets_the_pace(name):
    # GPUs so fast that every call waits for the host's launches: a second GPU's process launches the same kernels,
    # so a split call is no faster, and its collectives make it slower: auto keeps every call on one GPU
    inventory = pipemap.inspect(name, dtype=torch.bfloat16)
    fast = Hardware.parse("2x80GiB,cpu=128GiB,flops=1000P,mem_bw=1000TB")
    chosen = pipemap.plan(inventory, hardware=fast, strategy="auto")
    assert all(not p.replicas for p in chosen.components)
    priced = {c.strategy: c.seconds for c in chosen.candidates}
    assert priced["parallel"] >= priced["balanced"] == min(s for s in priced.values() if s is not None)
    assert "launch-bound" in " ".join(chosen.notes)
    # the same pipeline on datasheet GPUs: the split pays where the GPU's work sets the pace (flux.1-dev)
    slow = pipemap.plan(inventory, hardware=Hardware.parse("2x80GiB,cpu=128GiB"), strategy="auto")
    assert any(p.replicas for p in slow.components) == (name == "flux.1-dev")


def test_both_branches_split_on_four_gpus_hide_one_call_a_step_and_share_each_call_by_half():
    plain, _ = _cost("resident", CFG)
    split, half = _cost("sequence", CFG)  # each call's tokens over two GPUs: what each half does
    cost, placement = _cost("guidance_sequence", CFG, copies=3)
    kept = 1 - (CFG.steps - 1) / CFG.calls  # 11 calls of 20 wait: those the second half does not hide
    assert cost.compute == pytest.approx(split.compute * kept)
    assert cost.transfer == pytest.approx(split.transfer * kept + (
        (CFG.steps - 1) * CFG.latent_tokens * REPLICA_BYTES_PER_TOKEN + PROMPT_BYTES) / PERF.peer_bandwidth)
    assert moved_per_image(placement, TRANSFORMER, CFG) == pytest.approx(
        moved_per_image(half, TRANSFORMER, CFG) + moved_per_image(_cost("guidance", CFG)[1], TRANSFORMER, CFG))
    # faster than either alone on the GPUs it uses, slower than a perfect 4x
    assert plain.total / 4 < cost.total < min(split.total, _cost("guidance", CFG)[0].total)
    busy = device_seconds(pipemap.Plan("parallel", (placement,), (), "cuda:0", "bfloat16"),
                          Inventory("t", "WanPipeline", (TRANSFORMER,), "bfloat16"), PERF, CFG)
    assert busy == pytest.approx({f"cuda:{i}": cost.total for i in range(4)})
    distilled = Workload(1024, 1024, 10, False, text_tokens=512)  # one call a step: only the split helps
    assert _cost("guidance_sequence", distilled, copies=3)[0].total == pytest.approx(
        _cost("sequence", distilled)[0].total)
