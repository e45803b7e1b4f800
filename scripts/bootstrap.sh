#!/usr/bin/env bash
# Create ./.venv with trajectory-replay (editable) and its test tools.
# torch: TORCH_VERSION (default 2.13.0) from TORCH_INDEX_URL when set, e.g. the CPU-only
# wheel index https://download.pytorch.org/whl/cpu, which is far smaller than the default CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
.venv/bin/python -m pip install -q -e ".[test]"
