#!/usr/bin/env bash
# Set everything up, then lint and run the whole test suite (CPU only, no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test  # pipemap and its test tools (after a demo-only install too)
# the home page's browser test drives a headless Chromium (Selenium): install it from the system's packages where
# missing; without it that one test is skipped and says why
have_browser() { command -v chromedriver >/dev/null && { command -v chromium || command -v chromium-browser \
    || command -v google-chrome; } >/dev/null; }
if ! have_browser && command -v apt-get >/dev/null; then
    echo "pipemap test: installing chromium and chromium-driver (apt) for the browser test"
    sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    { "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
        chromium chromium-driver >/dev/null; } || echo "pipemap test: could not install Chromium; skipping its test"
fi
# one thread: on 2 shared cores torch's thread pool once made a tiny call 100x slower
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests bench
.venv/bin/mypy
# one worker per core (pytest-xdist), an idle one taking tests queued for another (worksteal): the long tests
# then finish together; PIPEMAP_TEST_WORKERS=0 runs in this process
exec .venv/bin/python -m pytest -q -n "${PIPEMAP_TEST_WORKERS:-auto}" --dist worksteal "$@"
