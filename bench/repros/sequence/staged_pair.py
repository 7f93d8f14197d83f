"""S1: the sequence split's exchange (hooks/exchange.py) copies between GPUs with plain ``.to(device)``/``copy_``, not
through ``transfer.move_tensor``, so a GPU pair that ``check_transfers`` found corrupting (two RTX 4090s on drivers
before 550.40.07: peer-to-peer copies arrive as zeros, no error) and staged through host memory is still copied
directly by every all-to-all and all-gather: a sequence-split call then computes attention on zeros.

Under the project's fake CUDA (tests/fakecuda.py, 2 GPUs) with direct GPU<->GPU copies made to write zeros (the
driver bug), ``ensure_safe_transfers`` finds and stages both directions; then
 1. ``move_tensor`` (what replica/guidance copies use) arrives intact (staged through host memory);
 2. ``ThreadGroup.all_to_all_single`` and ``allgather_into_tensor_coalesced`` (what diffusers' Ulysses attention and
    pipemap's gather reach through torch's functional collectives) run in two rank threads, as in a sequence call.
Prints OK/FAIL per path.

Run from the project root:  nice -n 10 .venv/bin/python ../shared/context/gpu-path-repros-round4/seq_staged_pair.py
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

import torch  # noqa: E402

import fakecuda  # noqa: E402
from pipemap.runtime import transfer  # noqa: E402
from pipemap.hooks.exchange import release, thread_groups  # noqa: E402


def corrupting_peer_copies(fake):
    """Direct copies between two fake GPUs arrive as zeros (the RTX 40 P2P driver bug); host<->GPU copies are fine."""
    to_copy, copy_ = fake.to_copy, fake.copy_

    def broken_to_copy(source, kwargs):
        out = to_copy(source, kwargs)
        if isinstance(source, fakecuda.CudaTensor) and isinstance(out, fakecuda.CudaTensor) \
                and source.device != out.device:
            out.inner.zero_()
        return out

    def broken_copy_(destination, source, non_blocking):
        out = copy_(destination, source, non_blocking)
        if isinstance(source, fakecuda.CudaTensor) and isinstance(destination, fakecuda.CudaTensor) \
                and source.device != destination.device:
            destination.inner.zero_()
        return out

    fake.to_copy, fake.copy_ = broken_to_copy, broken_copy_


def main() -> int:
    os.environ.setdefault("PIPEMAP_CACHE_DIR", os.path.join(__import__("tempfile").gettempdir(), "pipemap-transfer-cache"))
    fake = fakecuda.install(gpus=2)
    try:
        corrupting_peer_copies(fake)
        transfer.clear_transfer_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = transfer.ensure_safe_transfers(["cuda:0", "cuda:1"])
        print(f"check_transfers: corrupted={report.corrupted}; staged={sorted(transfer.staged_pairs())}")

        x = torch.arange(1, 9, dtype=torch.float32, device="cuda:0")
        moved = transfer.move_tensor(x, torch.device("cuda:1"))
        good = torch.equal(fakecuda.host(moved), fakecuda.host(x))
        print(f"{'OK' if good else 'FAIL'}: move_tensor cuda:0 -> cuda:1 on the staged pair arrives intact")

        groups = thread_groups(2, "repro")
        inputs = [torch.arange(1, 9, dtype=torch.float32, device=f"cuda:{r}") * (r + 1) for r in range(2)]
        outputs = [torch.empty(8, device=f"cuda:{r}") for r in range(2)]
        gathered = [torch.empty(16, device=f"cuda:{r}") for r in range(2)]

        def rank(r):
            groups[r].all_to_all_single(outputs[r], inputs[r], [4, 4], [4, 4])
            groups[r].allgather_into_tensor_coalesced([gathered[r]], [inputs[r]])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        release(groups)
        want = [torch.cat([fakecuda.host(inputs[s])[4 * r:4 * r + 4] for s in range(2)]) for r in range(2)]
        want_gather = torch.cat([fakecuda.host(i) for i in inputs])
        for r in range(2):
            a2a = torch.equal(fakecuda.host(outputs[r]), want[r])
            ag = torch.equal(fakecuda.host(gathered[r]), want_gather)
            print(f"{'OK' if a2a else 'FAIL'}: rank {r} all_to_all_single on the staged pair: got "
                  f"{fakecuda.host(outputs[r]).tolist()} want {want[r].tolist()}")
            print(f"{'OK' if ag else 'FAIL'}: rank {r} all-gather on the staged pair: got "
                  f"{fakecuda.host(gathered[r]).tolist()}")
        print(f"fake CUDA races: {len(fake.races)}")
    finally:
        transfer.clear_staged()
        fake.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
