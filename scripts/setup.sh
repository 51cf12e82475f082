#!/usr/bin/env bash
# Create .venv and install qconv with the given extras (default: gguf). Idempotent.
# torch is pinned to the CPU wheel this machine keeps on disk; nothing here may pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-gguf}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${extras}]"
echo "qconv installed in .venv with extras [${extras}]"
