"""workers.digest, which decides whether a worker keeps its own copy of a tensor or is sent rank 0's, is two sums
(plain, and weighted by position mod 65521): two elements swapped 65521 positions apart keep both sums, so a changed
tensor reads as unchanged and the worker keeps its stale copy.

Run from the project root (one command):
  PYTHONPATH=src python bench/repros/workers/digest_is_a_hash.py
"""
import torch

from pipemap.hooks.payload import digest

w = torch.randn(4096, 64, dtype=torch.bfloat16)  # a 4096x64 weight: 262144 elements
changed = w.clone().view(-1)
i, j = 10, 10 + 65521
changed[i], changed[j] = w.view(-1)[j], w.view(-1)[i]
changed = changed.view_as(w)
print("tensors equal:", torch.equal(w, changed), "| digests equal:", digest(w) == digest(changed))
print(("FAIL" if digest(w) == digest(changed) and not torch.equal(w, changed) else "OK")
      + ": a changed tensor gets a digest of its own")
