#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one device call (about 9.5 minutes of the 15):
#
#   run(command="bash bench/gpu_run.sh $OUT", carry=[".whl"], timeout_s=600)    # .whl from bash bench/fetch_wheels.sh
#
# 1. bench/gpu_check.sh into $OUT/gc (the offloading methods against diffusers', lifetime, bandwidth, transfers,
#    doctor; LIMIT seconds, install included), its options after the folder;
# 2. bench/workers.py --device cuda into $OUT (workers.md, workers.log): the host time per call of each way a split
#    denoiser's other rank runs (plain, thread, worker process), per rank. On one GPU both planned GPUs go onto it
#    and a worker joins over gloo through the host; on two, over NCCL (never run yet). With RAY=1 (Ray installed on
#    the machine: its wheel is over the carry limit), also the worker as a Ray actor (PIPEMAP_WORKERS=ray);
# 3. bench/gpu_workers.py into $OUT (gpu_workers.md/.json): the worker path's correctness where NCCL runs (WP14 of
#    bench/repros/workers/REVIEW.md): each split mode equal to plain, a worker killed and one out of memory inside a
#    sequence split raised typed within 10 s (on NCCL: the group aborted), the call after on new workers.
# The wheels go into a folder of this call's own: pip --target keeps what an earlier call on a warm machine put in
# a shared one (the H200's first run imported a stale transformers so). bench/README.md says how to read both.
set -uo pipefail
out=${1:?usage: bash bench/gpu_run.sh OUT_DIR [gpu_check.py options]}
shift
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$out"
export SITE=${SITE:-/tmp/pipemap-site-$$} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-420} bash bench/gpu_check.sh "$out/gc" "$@"
echo "== bench/workers.py --device cuda"
PYTHONPATH="$SITE:$PWD/src" timeout -k 10 "${WORKERS_LIMIT:-170}" "$PY" -X faulthandler bench/workers.py --device cuda \
    --repeats 5 --scale 8 --steps 4 --out "$out" ${RAY:+--ray} 2>&1 | tee "$out/workers.log" \
    | grep -v "UserWarning\|F.linear"
echo "== bench/gpu_workers.py"
PYTHONPATH="$SITE:$PWD/src" timeout -k 10 "${GPU_WORKERS_LIMIT:-150}" "$PY" -X faulthandler bench/gpu_workers.py "$out" \
    2>&1 | tee "$out/gpu_workers.log" | grep -v "UserWarning"
