"""Run a command and print the CPU time of its whole process tree, the processes it orphaned included (a
forkserver's workers, Ray's daemons): this process is made their subreaper and waits for every one.

    python scripts/treecpu.py python -m pytest -q tests/hooks/test_workers.py

Linux only (``PR_SET_CHILD_SUBREAPER``). Wall time on a shared machine says little; CPU time of the tree does."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    began = time.monotonic()
    code = subprocess.call(argv)
    ended = time.monotonic()
    while True:  # what the command left running (orphans reparented here) ends before the count is read
        try:
            os.wait()
        except ChildProcessError:
            break
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"treecpu: exit {code}, wall {ended - began:.1f} s, tree CPU {used.ru_utime + used.ru_stime:.1f} s "
          f"(user {used.ru_utime:.1f}, sys {used.ru_stime:.1f})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
