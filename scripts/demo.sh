#!/usr/bin/env bash
# Set everything up, then run `pipemap demo` on the embedded tiny pipeline. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo  # pipemap alone: the demo needs none of the test tools
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1
exec .venv/bin/pipemap demo "$@"
