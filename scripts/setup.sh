#!/usr/bin/env bash
# Create .venv (if missing) and install pipemap with its test tools. torch is pinned to the CPU build 2.13.0 here:
# an unpinned torch would pull a multi-GB CUDA build. pipemap itself accepts any recent torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import pipemap, torch; print(f'pipemap {pipemap.__version__} ready (torch {torch.__version__})')"
