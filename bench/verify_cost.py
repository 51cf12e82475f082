"""What a token-tree verify forward costs against a decode step, fused (one masked attention call), exact (one
attention call per row, bit-equal to decoding each node's path: model.exact_rows / exact_attention) and root-exact
(the root row exact, the other nodes one fused call: what TreeSpeculator.step runs in exact mode), in bf16.

The tree is shaped like a lookup tree: a first path of `--first-path` nodes, then branches hanging off random
earlier nodes (seeded). Prints one JSON line: median milliseconds per forward over `--repeats` runs.

    .venv/bin/python bench/verify_cost.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def lookup_like_tree(T: int, first_path: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [T], ancestors [T, T]) in parent-before-child order, as Transformer.forward(tree=) takes."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [i - 1 if i < first_path else int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
    depth = torch.zeros(T, dtype=torch.long)
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i], anc[i] = depth[p] + 1, anc[p]
        anc[i, i] = True
    return depth, anc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".cache" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--history", type=int, default=600, help="tokens already in the cache")
    ap.add_argument("--sizes", default="16,32,64")
    ap.add_argument("--first-path", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from qconv.engine.loader import load_model

    model = load_model(a.model, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    cache = model.new_cache(1, a.history + 128)
    model(torch.randint(0, V, (1, a.history), generator=g), cache)

    def median_ms(T: int, exact: bool, prefix: int | None = None) -> float:
        tokens = torch.randint(0, V, (1, T), generator=g)
        tree = lookup_like_tree(T, a.first_path) if T > 1 else None
        times = []
        for _ in range(a.repeats):
            n = int(cache.lengths[0])
            t0 = time.perf_counter()
            model(tokens, cache, tree=tree, exact=exact, exact_prefix=prefix)
            times.append(time.perf_counter() - t0)
            cache.rollback([0], [n])
        return round(1e3 * sorted(times)[len(times) // 2], 1)

    out = {
        "bench": "verify_cost",
        "model": a.model,
        "exact_verify": bool(model.exact_verify),
        "history": a.history,
        "threads": torch.get_num_threads(),
        "decode_ms": median_ms(1, False),
    }
    for T in (int(s) for s in a.sizes.split(",")):
        out[f"T{T}"] = {
            "fused_ms": median_ms(T, False),
            "exact_ms": median_ms(T, True),
            "root_exact_ms": median_ms(T, False, 1),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
