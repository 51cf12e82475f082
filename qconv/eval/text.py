"""Held-out text for quality measurement: a local file or an HF dataset id, tokenized into fixed windows.

The text's sha256 is part of the reference-logits cache key, so the same words always meet the same reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qconv.errors import QconvError
from qconv.fsutil import sha256_bytes


@dataclass
class HeldOutText:
    label: str  # what the user passed
    text: str

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.text.encode())


@dataclass
class Windows:
    """Token windows of one text. Window i covers ids[i*stride : i*stride + window]; the first window scores
    every position, later ones only their last `stride` positions (the rest is context already scored)."""

    ids: list[list[int]]
    window: int
    stride: int

    def first_scored(self, i: int) -> int:
        return 0 if i == 0 else self.window - self.stride

    @property
    def num_scored(self) -> int:
        return sum(len(w) - 1 - self.first_scored(i) for i, w in enumerate(self.ids))


def _from_dataset(spec: str) -> str:
    """`org/name[:config][@split]` through `datasets` (offline it must already be in the HF cache)."""
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "test")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for "not found / offline"
        raise QconvError(
            f"cannot load held-out text {spec!r}: {type(e).__name__}: {e}",
            where="--text",
            fix="pass a local text file, or an HF dataset id as org/name[:config][@split] "
            "that is reachable or already cached",
        ) from e
    col = (
        "text"
        if "text" in ds.column_names
        else next((c for c in ds.column_names if ds.features[c].dtype == "string"), None)
    )
    if col is None:
        raise QconvError(
            f"dataset {spec!r} has no text column (columns: {ds.column_names})",
            where="--text",
            fix="pass a dataset with a `text` column, or a local text file",
        )
    return "\n".join(ds[col])


def load_text(spec: str | Path) -> HeldOutText:
    """A .txt/.md file is read as is; a .jsonl file joins each record's `text`; otherwise an HF dataset id."""
    p = Path(spec).expanduser()
    if p.is_file():
        raw = p.read_text(errors="replace")
        if p.suffix == ".jsonl":
            import json

            raw = "\n".join(json.loads(line).get("text", "") for line in raw.splitlines() if line.strip())
        return HeldOutText(label=str(p), text=raw)
    if p.exists() or str(spec).startswith((".", "/", "~")) or p.suffix in (".txt", ".jsonl", ".md"):
        raise QconvError(
            f"held-out text file not found: {spec}",
            where="--text",
            fix="pass an existing text file or an HF dataset id (org/name[:config][@split])",
        )
    return HeldOutText(label=str(spec), text=_from_dataset(str(spec)))


def make_windows(
    tokenizer, text: HeldOutText, *, window: int, max_tokens: int | None = None, stride: int | None = None
) -> Windows:
    stride = stride or window
    if window < 2 or not 0 < stride <= window:
        raise QconvError(
            f"bad window/stride {window}/{stride}", where="--window", fix="use window >= 2 and 0 < stride <= window"
        )
    ids = tokenizer(text.text, add_special_tokens=False)["input_ids"]
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < window:
        raise QconvError(
            f"held-out text has {len(ids)} tokens, shorter than one window of {window}",
            where=text.label,
            fix="pass a longer text or a smaller --window",
        )
    starts = range(0, len(ids) - window + 1, stride)
    return Windows(ids=[ids[s : s + window] for s in starts], window=window, stride=stride)
