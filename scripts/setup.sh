#!/usr/bin/env bash
# Create .venv (if missing) and install pipemap: `setup.sh` (or `setup.sh test`) with its test tools, what
# scripts/test.sh needs; `setup.sh demo` pipemap alone, what scripts/demo.sh needs. torch is pinned to the CPU build
# 2.13.0 here: an unpinned torch would pull a multi-GB CUDA build. pipemap itself accepts any recent torch.
#
# A stamp in .venv records a hash of pyproject.toml (and this script) per install: .pipemap-setup for the test
# tools, .pipemap-setup-demo for pipemap alone. When the one asked for matches (the test install serves the demo
# too), everything is installed already and setup takes a fraction of a second, so scripts/demo.sh and
# scripts/test.sh start at once the second time; after a demo-only install, scripts/test.sh installs the test tools.
# Delete the stamps (or change pyproject.toml) to install again.
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-test}"
case "$want" in
    test) spec=".[test]"; stamp=.venv/.pipemap-setup; what="pipemap and its test tools" ;;
    demo) spec="."; stamp=.venv/.pipemap-setup-demo; what="pipemap" ;;
    *) echo "pipemap setup: unknown install '$want' (test or demo)" >&2; exit 2 ;;
esac
key="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$key" ]; }
if [ -x .venv/bin/python ] && { stamped "$stamp" || { [ "$want" = demo ] && stamped .venv/.pipemap-setup; }; }; then
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
echo "pipemap setup: installing $what"
"${pip[@]}" -e "$spec" 2>&1 | grep -v "^WARNING: Location\|^Requirement already satisfied" || true
.venv/bin/python -c "import pipemap, torch; print(f'pipemap {pipemap.__version__} ready (torch {torch.__version__})')"
echo "$key" > "$stamp"
