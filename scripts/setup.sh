#!/usr/bin/env bash
# Create .venv (if missing) and install pipemap with its test tools. torch is pinned to the CPU build 2.13.0 here:
# an unpinned torch would pull a multi-GB CUDA build. pipemap itself accepts any recent torch.
#
# A stamp in .venv records a hash of pyproject.toml (and this script): when it matches, everything is installed
# already and setup takes a fraction of a second, so scripts/demo.sh and scripts/test.sh start at once the second
# time. Delete .venv/.pipemap-setup (or change pyproject.toml) to install again.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.pipemap-setup
key="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    echo "pipemap setup: creating .venv"
    python3 -m venv .venv
fi
echo "pipemap setup: installing torch 2.13.0 (CPU build, about 200 MB) and pipemap's dependencies; this takes" \
     "a few minutes the first time"
pip=(.venv/bin/python -m pip install --disable-pip-version-check --progress-bar on)
"${pip[@]}" torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
echo "pipemap setup: installing pipemap and its test tools"
"${pip[@]}" -e ".[test]" 2>&1 | grep -v "^WARNING: Location\|^Requirement already satisfied" || true
.venv/bin/python -c "import pipemap, torch; print(f'pipemap {pipemap.__version__} ready (torch {torch.__version__})')"
echo "$key" > "$stamp"
