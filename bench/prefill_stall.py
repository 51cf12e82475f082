"""How long one long prompt holds up a short request in the native server's scheduler (chunked prefill): a
1,000-token prompt is submitted, a 2-token request 0.2 s later; prints, per prefill chunk size, when each got its
first token. A chunk as large as the prompt is the unchunked prefill.

    python bench/prefill_stall.py [--model DIR] [--chunks 4096,256,64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_run(model, tok, long_ids: list[int], chunk: int) -> tuple[float, float]:
    from qconv.serve.scheduler import GenRequest, Scheduler

    sched = Scheduler(model, tok, max_batch=4, max_len=2048, prefill_chunk=chunk).start()
    first: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        sched.submit(GenRequest(long_ids, 1, lambda ev: first.setdefault("long", time.monotonic())))
        time.sleep(0.2)
        t1 = time.monotonic()
        sched.submit(
            GenRequest(tok("Hi").input_ids[:2] or [1, 2], 1, lambda ev: first.setdefault("short", time.monotonic()))
        )
        while len(first) < 2:
            time.sleep(0.005)
    finally:
        sched.stop()
    return first["long"] - t0, first["short"] - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / ".cache" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--text", default="/work/shared/data/tinyshakespeare.txt")
    ap.add_argument("--chunks", default="4096,256,64")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from qconv.engine.loader import load_model, load_tokenizer

    model, tok = load_model(args.model), load_tokenizer(args.model)
    long_ids = tok(Path(args.text).read_text()[:20000]).input_ids[:1000]
    for chunk in map(int, args.chunks.split(",")):
        for _ in range(args.repeats):
            long_s, short_s = one_run(model, tok, long_ids, chunk)
            print(
                f"chunk {chunk}: 1,000-token prompt first token {long_s:.2f} s; 2-token request waited {short_s:.2f} s"
            )


if __name__ == "__main__":
    main()
