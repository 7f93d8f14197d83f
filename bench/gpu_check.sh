#!/usr/bin/env bash
# pipemap's GPU check, one script for one GPU machine (the device tool's H200), done in under 10 minutes (7 for
# bench/gpu_check.py, then up to 2.5 for bench/gpu_workers.py, the worker processes over NCCL):
#
#   bash bench/gpu_check.sh "$OUT"                 # on the GPU machine; carry [".whl"] (bench/fetch_wheels.sh)
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh /tmp/gpu-check --dry-cpu    # here, without a GPU
#
# It installs the carried wheels (diffusers is not on that machine), then runs bench/gpu_check.py under a timeout,
# its --time-budget what is left of LIMIT (every section of it capped in turn); that writes table.md and
# results.json into the folder given first, and this script adds log.txt beside them.
# Options after the folder go to gpu_check.py (--help lists them). bench/README.md says how to read the result.
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [gpu_check.py options]}
shift
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
LIMIT=${LIMIT:-420}  # seconds for everything, the install included: 7 minutes

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "installing .whl/*.whl failed" | tee "$out/log.txt"; exit 1; }
    export PYTHONPATH="$SITE:$PWD/src"
else
    echo "no .whl/*.whl: using the installed packages (run bash bench/fetch_wheels.sh here and carry .whl)"
    export PYTHONPATH="$PWD/src"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error \
    DIFFUSERS_VERBOSITY=error PIPEMAP_CACHE_DIR=${PIPEMAP_CACHE_DIR:-/tmp/pipemap-cache}

{
    echo "gpu_check.sh: $(date -u +%FT%TZ), $(uname -m), ${SECONDS}s after start"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
        --format=csv,noheader
    "$PY" -c 'import sys, torch, diffusers, transformers, accelerate
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, diffusers {diffusers.__version__} "
      f"({diffusers.__file__}), transformers {transformers.__version__}, accelerate {accelerate.__version__}")'
} 2>&1 | tee "$out/log.txt"

left=$((LIMIT - SECONDS))
# the script plans within --time-budget (a later --time-budget among the options wins); timeout is the backstop
timeout -k 10 "$left" "$PY" bench/gpu_check.py "$out" --time-budget "$((left - 15))" "$@" 2>&1 | tee -a "$out/log.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "gpu_check.py stopped at the ${left}s limit; table.md/results.json hold what it finished" \
    | tee -a "$out/log.txt"
# the worker processes where NCCL runs (issue 48): each split mode equal to plain, a worker killed and one raising
# inside a sequence split, typed within seconds, the next call working (gpu_workers.md/.json beside table.md)
echo "== bench/gpu_workers.py" | tee -a "$out/log.txt"
timeout -k 10 "${GPU_WORKERS_LIMIT:-150}" "$PY" -X faulthandler bench/gpu_workers.py "$out" 2>&1 \
    | grep -v "UserWarning" | tee -a "$out/log.txt"
workers_rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] && rc=$workers_rc
exit "$rc"
