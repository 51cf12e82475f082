"""Load benchmark of `qconv serve` (native engine, continuous batching) on SmolLM2-135M-Instruct: one streaming
client alone, then 8 and 32 at once; greedy outputs must match the single-client runs. Prints one JSON line.

    python bench/serve_load.py [--model DIR] [--max-tokens 32] [--max-batch 32] [--threads 1] [--spec-tokens 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = [
    "the sea",
    "a red bicycle",
    "winter mornings",
    "coffee",
    "the moon",
    "a lost key",
    "mountains",
    "rain",
    "a library",
    "trains",
    "old maps",
    "a garden",
    "the desert",
    "bread",
    "a violin",
    "city lights",
    "owls",
    "a small boat",
    "autumn leaves",
    "chess",
    "a lighthouse",
    "snow",
    "a market",
    "clocks",
    "the river",
    "a kite",
    "honey",
    "thunder",
    "a bridge",
    "paper planes",
    "the forest",
    "a candle",
]
PROMPTS = [f"Write two sentences about {t}." for t in TOPICS]


def smollm2_dir() -> Path:
    out = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():
        from qconv.convert.gguf import import_gguf
        from qconv.paths import embedded_gguf

        import_gguf(embedded_gguf(), out, force=True)
    return out


def run(model_dir: Path, max_tokens: int, max_batch: int, port: int, threads: int | None, spec: int) -> dict:
    import openai

    from tests.serve_helpers import ServerProcess, run_load

    args = [
        str(model_dir),
        "--backend",
        "native",
        "--max-batch",
        str(max_batch),
        "--max-model-len",
        "512",
        "--spec-tokens",
        str(spec),
    ]
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    with ServerProcess(args, port, env=env) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        run_load(client, name, PROMPTS[:1], 1, 4)  # warm-up
        single = run_load(client, name, PROMPTS, 1, max_tokens)
        c8 = run_load(client, name, PROMPTS[:8], 8, max_tokens)
        one = run_load(client, name, PROMPTS[8:9], 1, max_tokens)  # single client again, next to the 8-client run
        c32 = run_load(client, name, PROMPTS, 32, max_tokens)
        # the load test's rate: short raw completions, where decode (what batching shares) dominates prefill
        starts = [f"The story of {t}" for t in TOPICS[:8]]
        raw1 = run_load(client, name, starts[:2], 1, max_tokens, chat=False)
        raw8 = run_load(client, name, starts, 8, max_tokens, chat=False)
    solo = {r.prompt: r.text for r in single.results}
    single_tps = (single.tokens_per_s + one.tokens_per_s) / 2
    return {
        "bench": "serve_load",
        "model": model_dir.name,
        "max_tokens": max_tokens,
        "max_batch": max_batch,
        "server_threads": threads or "default",
        "spec_tokens": spec,
        "single_tok_s": round(single_tps, 2),
        "c8_tok_s": round(c8.tokens_per_s, 2),
        "c32_tok_s": round(c32.tokens_per_s, 2),
        "c8_over_single": round(c8.tokens_per_s / single_tps, 2),
        "c32_over_single": round(c32.tokens_per_s / single_tps, 2),
        "raw_single_tok_s": round(raw1.tokens_per_s, 2),
        "raw_c8_tok_s": round(raw8.tokens_per_s, 2),
        "raw_c8_over_single": round(raw8.tokens_per_s / raw1.tokens_per_s, 2),
        "c32_completed": sum(r.finish_reason is not None for r in c32.results),
        "c32_greedy_matches_single": sum(r.text == solo[r.prompt] for r in c32.results),
        "c8_greedy_matches_single": sum(r.text == solo[r.prompt] for r in c8.results),
        "c32_ttft_p50_s": round(statistics.median(r.ttft for r in c32.results), 3),
        "single_ttft_p50_s": round(statistics.median(r.ttft for r in single.results), 3),
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the server (default: torch's)")
    ap.add_argument("--spec-tokens", type=int, default=0, help="prompt-lookup drafts per step (0: off)")
    a = ap.parse_args()
    from tests.serve_helpers import free_port

    print(
        json.dumps(
            run(a.model or smollm2_dir(), a.max_tokens, a.max_batch, a.port or free_port(), a.threads, a.spec_tokens)
        )
    )


if __name__ == "__main__":
    main()
