#!/usr/bin/env bash
# Fetch the wheels bench/gpu_check.sh installs on the GPU machine (no registry there) into .whl/ (git-ignored).
#
#   bash bench/fetch_wheels.sh                 # what the H200 image lacks: diffusers and its two missing needs
#   bash bench/fetch_wheels.sh --match-local   # also transformers and accelerate at this venv's versions
#   bash bench/fetch_wheels.sh NAME==VER ...   # extra wheels, added to the default set
#
# The device image (/work/.library/device/KINDS.md) already holds torch 2.11, transformers 5.17, accelerate 1.15,
# huggingface_hub 1.33, safetensors 0.8, tokenizers 0.23, numpy, pillow, regex, requests, filelock, fsspec, pyyaml,
# packaging, psutil, rich (+ markdown-it-py, mdurl, pygments), tqdm, typer, shellingham, annotated-doc, hf-xet, zipp,
# idna, urllib3, certifi and charset-normalizer, so those are not carried. It lacks diffusers, whose Requires-Dist
# (importlib_metadata, filelock, huggingface-hub>=1.32,<3, numpy, regex, requests, safetensors>=0.8, Pillow) it
# meets except importlib_metadata; that needs zipp (there) and lazy-importer (not there). pipemap itself is not
# carried as a wheel: the working tree travels, and gpu_check.sh puts src/ on PYTHONPATH.
#
# Versions are the ones installed in this repo's .venv (what the tests run against), else the newest. Every wheel
# is fetched with --no-deps (pip there installs with --no-deps too); the Requires-Dist lines of each are printed
# so a new need shows up here, not on the device.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
names=(diffusers importlib_metadata lazy-importer)
extra=()
for arg in "$@"; do
    case "$arg" in
        --match-local) names+=(transformers accelerate) ;;
        -h|--help) sed -n 2,20p "$0"; exit 0 ;;
        *) extra+=("$arg") ;;
    esac
done

pinned() {  # NAME -> NAME==VERSION installed here, or NAME when it is not installed
    "$PY" - "$1" <<'EOF'
import importlib.metadata as m, sys
try:
    print(f"{sys.argv[1]}=={m.version(sys.argv[1])}")
except m.PackageNotFoundError:
    print(sys.argv[1])
EOF
}

specs=()
for name in "${names[@]}"; do specs+=("$(pinned "$name")"); done
specs+=("${extra[@]}")

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: two stop the whole install on the device

platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
echo "fetching: ${specs[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${specs[@]}"

echo
echo "Requires-Dist (extras left out) of each wheel:"
for whl in .whl/*.whl; do
    echo "  $(basename "$whl")"
    unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/      /' || true
done
echo
echo "sizes:"
du -b .whl/*.whl | awk '{printf "  %8.1f KiB  %s\n", $1 / 1024, $2; total += $1}
                        END {printf "  %8.1f MiB  total (the working tree that travels must stay under 64 MiB)\n",
                             total / 1048576}'
