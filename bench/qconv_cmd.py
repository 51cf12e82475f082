"""qconv command lines for the bench scripts that run it in a child process (`python bench/X.py` from the repo root
puts bench/ on sys.path, so they import this by name)."""

from __future__ import annotations

import sys

QCONV = [sys.executable, "-m", "qconv.cli"]


def build_args(recipe, model, out, *args) -> list[str]:
    """The words of `qconv build --recipe RECIPE --model MODEL --out OUT ARGS`."""
    return [str(a) for a in ("build", "--recipe", recipe, "--model", model, "--out", out, *args)]


def streamed_build(model, out, dataset, samples: int, seq_len: int, work, *args) -> list[str]:
    """A RAM-bounded 3090 build from scratch (`--stream --force --fresh`), as the memory benches run it."""
    cal = ("--dataset", dataset, "--samples", samples, "--seq-len", seq_len)
    return [*QCONV, *build_args("3090", model, out, *cal, "--stream", "--force", "--fresh", "--work-dir", work, *args)]
