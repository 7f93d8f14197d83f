"""Question 1: where the project's fake CUDA (tests/fakecuda.py) is kinder than a GPU. Each check runs something a
GPU would fail on (or run differently) and prints KIND (the fake lets it pass) or FAITHFUL.

 1. host writes into pinned memory an asynchronous copy still reads: a staging ring refilled without waiting for the
    copy out of the slot (hooks/mapped.py:137 ``host_wait`` removed) leaves no race under the fake: it checks host
    memory only at cudaHostRegister/Unregister, and ``pin_memory=True`` buffers are not even pinned there
    (fakecuda.py HostMode pops ``pin_memory``).
 2. the caching allocator: the fake refuses an allocation only when *allocated* bytes pass the cap, with one 512-byte
    rounding; CUDA caps *reserved* bytes (``set_per_process_memory_fraction``), rounds allocations over 1 MiB to
    2 MiB and never merges blocks across segments, so fragmentation raises out-of-memory with allocated < cap.
 3. out-of-memory messages: the fake's names no "GPU N" (fakecuda.py:280); admission._failure (admission.py:490-498)
    reads the failing GPU from it, so the branch a real OOM on a copy's GPU takes is never run under the fake.
 4. the sequence split cannot run under the fake at all (torch's functional collectives): tests/hooks/test_copies.py
    says so; here the call's error is shown.
 5. streams: ``torch.cuda.Stream()`` hands out one of 32 pooled streams per device and priority (round robin), so
    the 33rd CudaQueues' side stream is an earlier one's; the fake makes a new stream each time.

Run from the project root:  nice -n 10 .venv/bin/python ../shared/context/gpu-path-repros-round4/fake_fidelity.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

import torch  # noqa: E402

import fakecuda  # noqa: E402


def staging_without_host_wait() -> None:
    from pipemap.hooks.mapped import Staging
    from pipemap.hooks.packing import Packing
    from pipemap.runtime.streams import CudaQueues

    fake = fakecuda.install(gpus=1)
    try:
        queues = CudaQueues(torch.device("cuda:0"))
        queues.host_wait = lambda event: None  # the mutation: refill a slot without waiting for its last copy
        staging = Staging(queues)
        staging.need(64)
        masters = [torch.arange(256, dtype=torch.uint8)]
        layout = Packing.of(masters)
        buffer = queues.alloc(layout.nbytes)
        event = staging.copy(buffer, layout, masters)  # 4 chunks through 2 slots: each slot refilled once
        queues.wait(event)
        races = fake.take()
        print(f"{'KIND' if not races else 'FAITHFUL'}: 1. staging slots refilled with no host wait: "
              f"{len(races)} race(s) reported (a GPU may copy the refilled bytes: wrong weights)")
    finally:
        fake.exit()


def fragmentation() -> None:
    fake = fakecuda.install(gpus=1)
    try:
        mib = 2**20
        torch.cuda.set_per_process_memory_fraction(100 * mib / fake.memory, 0)
        whole = torch.empty(95 * mib, dtype=torch.uint8, device="cuda:0")
        del whole  # a 95 MiB segment, cached
        parts = [torch.empty(30 * mib, dtype=torch.uint8, device="cuda:0") for _ in range(3)]  # split from it
        del parts[1]  # 30 MiB free in the middle, 5 MiB at the end: no 40 MiB run
        try:
            torch.empty(40 * mib, dtype=torch.uint8, device="cuda:0")
            outcome = "allocated"
        except torch.OutOfMemoryError:
            outcome = "out of memory"
        print(f"{'KIND' if outcome == 'allocated' else 'FAITHFUL'}: 2. 40 MiB after 30+30 MiB used in a 95 MiB cached "
              f"segment, cap 100 MiB: fake {outcome}, allocated {torch.cuda.memory_allocated(0) // mib} MiB, reserved "
              f"{torch.cuda.memory_reserved(0) // mib} MiB (CUDA: the segment cannot be freed, 95 + 40 > 100: out of "
              "memory)")
    finally:
        fake.exit()


def oom_message() -> None:
    fake = fakecuda.install(gpus=2)
    try:
        torch.cuda.set_per_process_memory_fraction(1e-6, 1)
        try:
            torch.empty(2**20, device="cuda:1")
            message = "(no error)"
        except torch.OutOfMemoryError as err:
            message = str(err)
        from pipemap.runtime.admission import _GPU, _TRIED

        gpu = _GPU.search(message)
        print(f"{'KIND' if not gpu else 'FAITHFUL'}: 3. fake OOM on cuda:1 says {message[:90]!r}; admission reads GPU "
              f"{gpu[1] if gpu else None!r}, tried {_TRIED.search(message)[0] if _TRIED.search(message) else None!r} "
              "(CUDA: 'Tried to allocate 1.00 MiB. GPU 1 has a total capacity of ...')")
    finally:
        fake.exit()


def sequence_under_fake() -> None:
    import pipemap
    from helpers import with_copy
    from pipemap import tiny

    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"))
    plain = torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)
    fake = fakecuda.install(gpus=2)
    faithful = False
    try:
        pipemap.dispatch(pipe, with_copy(pipe, "sequence"))
        try:
            out = fakecuda.host(torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images))
            diff = (out - plain).abs().max().item()
            faithful = diff <= 1e-4 and not fake.races
            outcome = f"ran on cuda:0+cuda:1, max |split - plain| {diff:.2e}, races {len(fake.races)}"
        except Exception as err:  # noqa: BLE001
            outcome = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
        print(f"{'FAITHFUL' if faithful else 'KIND'}: 4. the sequence split under the fake: {outcome}")
    finally:
        fake.exit()


def stream_pool() -> None:
    fake = fakecuda.install(gpus=1)
    try:
        streams = [torch.cuda.Stream(0) for _ in range(33)]
        print(f"{'KIND' if streams[32] != streams[0] else 'FAITHFUL'}: 5. 33 torch.cuda.Stream() on one device: "
              f"{len(set(streams))} distinct under the fake (CUDA: 32 pooled streams, the 33rd is the 1st)")
    finally:
        fake.exit()


def main() -> int:
    torch.set_num_threads(1)
    staging_without_host_wait()
    fragmentation()
    oom_message()
    stream_pool()
    sequence_under_fake()
    return 0


if __name__ == "__main__":
    sys.exit(main())
