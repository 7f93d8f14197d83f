#!/usr/bin/env bash
# Set everything up, then lint and run the whole test suite (CPU only, no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# one thread: on 2 shared cores torch's thread pool once made a tiny call 100x slower
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests bench
exec .venv/bin/python -m pytest -q "$@"
