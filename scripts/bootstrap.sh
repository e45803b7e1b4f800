#!/usr/bin/env bash
# Create ./.venv with trajectory-replay (editable), its test tools, verl and TRL (the tests replay real verl steps and
# real TRL GRPOTrainer runs) (and Debian's chromium, for the HTML
# report's rendering test, where apt-get is there to install it).
# torch: TORCH_VERSION (default 2.13.0) from TORCH_INDEX_URL when set, e.g. the CPU-only
# wheel index https://download.pytorch.org/whl/cpu, which is far smaller than the default CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
.venv/bin/python -m pip install -q -e ".[test,verl,trl]"
# The HTML report's test renders it in Debian's Chromium: installed here when missing and apt-get can.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
# Byte-compile the project's own modules now. Python does this itself on first import, except where
# PYTHONDONTWRITEBYTECODE is set (as in many container images): then every process would compile them again,
# about 0.3 s of CPU per command, and the test suite starts some hundred processes.
.venv/bin/python -m compileall -q -j 0 trajectory_replay tests examples benchmarks >/dev/null
