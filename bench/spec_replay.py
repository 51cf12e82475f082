"""Drafters replayed on saved greedy outputs (bench/spec_bench.py --save-outputs): under greedy verification a
drafter's verify steps depend on the token sequence alone, so tokens per verify step come without running a model.
Replays our prompt lookup (adaptive and fixed blocks), the stretch as the vLLM plugin runs it (a k-token lookup
head, the block after `after_saturated` fully accepted steps: HybridDrafter) against plain k-token lookup (vLLM's
n-gram), and transformers' prompt lookup. `lookup_oracle` bounds them all: each step takes the longest run of the
true continuation that follows any earlier occurrence of the sequence's last token (every suffix n-gram match is
one of those), as a drafter verifying all of them at once (a tree) with hindsight would. Prints one JSON line.

    python bench/spec_replay.py /tmp/outs.json --max-tokens 128 --block 15 --k 4 --after-saturated 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from spec_bench import transformers_lookup_replay  # noqa: E402

from qconv.engine.spec import Draft, DraftLength, HybridDrafter, PromptLookup, Speculator  # noqa: E402


class Capped:
    """A drafter's head of at most k tokens (the n-gram proposer's k), as the stretch's model drafter."""

    needs_hidden = False

    def __init__(self, inner: PromptLookup, k: int):
        self.inner, self.k = inner, k

    def begin(self, prompt, cache=None, slot=0):
        self.inner.begin(prompt, cache, slot)

    def observe(self, hidden, next_tokens):
        pass

    def propose(self, seq, k, most=None) -> Draft:
        return self.inner.propose(seq, min(k, self.k))


def replay(make, rows: list, max_tokens: int) -> float:
    """Tokens per verify step (prefill counted, as GenerationStats does) of the speculator make() builds."""
    tokens = steps = 0
    for prompt, out in rows:
        sp = make()
        sp.begin(prompt, None, 0, None, out[0])
        seq, pos, steps = list(prompt) + out[:1], 1, steps + 1
        while pos < len(out):
            d = sp.draft(seq, max_tokens - (len(seq) - len(prompt)) - 1)
            n = 0
            while n < len(d) and pos + n < len(out) and d.tokens[n] == out[pos + n]:
                n += 1
            new = out[pos : pos + n + 1]
            sp.verified(d, new, None)
            seq, pos, steps = seq + new, pos + len(new), steps + 1
        tokens += len(out)
    return round(tokens / max(steps, 1), 3)


def lookup_oracle(rows: list, block: int) -> float:
    """Tokens per verify step (prefill counted) of the hindsight bound on prompt lookup (module docstring)."""
    tokens = steps = 0
    for prompt, out in rows:
        seq, pos, steps = list(prompt) + out[:1], 1, steps + 1
        where: dict[int, list[int]] = {}
        for e in range(1, len(seq)):
            where.setdefault(seq[e - 1], []).append(e)
        while pos < len(out):
            best = 0
            for e in where.get(seq[-1], []):
                n = 0
                while n < block and pos + n < len(out) and e + n < len(seq) and seq[e + n] == out[pos + n]:
                    n += 1
                best = max(best, n)
            new = out[pos : pos + best + 1]
            for t in new:
                where.setdefault(seq[-1], []).append(len(seq))
                seq.append(t)
            pos, steps = pos + len(new), steps + 1
        tokens += len(out)
    return round(tokens / max(steps, 1), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outputs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=15)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--after-saturated", type=int, default=2)
    ap.add_argument("--ngram", default="1,4")
    ap.add_argument("--eos", type=int, default=2)
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.ngram.split(","))
    b = a.block
    drafters = {
        "lookup": lambda: Speculator(PromptLookup(lo, hi), DraftLength(b)),
        "lookup_fixed": lambda: Speculator(PromptLookup(lo, hi), DraftLength(b, adaptive=False)),
        "ngram_k": lambda: Speculator(PromptLookup(lo, hi), DraftLength(a.k, adaptive=False)),
        "stretched": lambda: Speculator(
            HybridDrafter(Capped(PromptLookup(lo, hi), a.k), PromptLookup(lo, hi), a.after_saturated),
            DraftLength(b, adaptive=False),
        ),
    }
    out = {
        "bench": "spec_replay",
        "outputs": a.outputs,
        "block": b,
        "k": a.k,
        "after_saturated": a.after_saturated,
        "ngram": [lo, hi],
        "workloads": {},
    }
    for w, rows in json.loads(Path(a.outputs).read_text()).items():
        r = {name: replay(make, rows, a.max_tokens) for name, make in drafters.items()}
        r["transformers"] = transformers_lookup_replay(
            [p for p, _ in rows], [o for _, o in rows], a.max_tokens, b, [a.eos]
        )["tokens_per_forward"]
        r["lookup_oracle"] = lookup_oracle(rows, b)
        r["stretched_over_ngram_k"] = round(r["stretched"] / r["ngram_k"], 3)
        r["lookup_over_transformers"] = round(r["lookup"] / r["transformers"], 3)
        r["lookup_fixed_over_transformers"] = round(r["lookup_fixed"] / r["transformers"], 3)
        r["lookup_oracle_over_transformers"] = round(r["lookup_oracle"] / r["transformers"], 3)
        out["workloads"][w] = r
    print(json.dumps(out))


if __name__ == "__main__":
    main()
