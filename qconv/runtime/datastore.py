"""Retrieval drafting (REST, He et al. 2023): a corpus of text the user points at (source code, docs, past
transcripts) tokenized once and indexed, so token trees can propose what followed the current suffix anywhere in
it. This predicts text that is in neither the prompt nor the output yet (`    return `, a library's call
patterns), which prompt lookup cannot. Lossless like every drafter: the target verifies every token.

Index: the token array sorted by its first `max_ngram` tokens (a suffix array truncated at the longest n-gram we
ever match: log2(max_ngram) stable sorts), so a query is two binary searches per n and memory is two int32 arrays.
Documents are joined by a separator (-1) that no query contains, so no match or continuation crosses one. Built
indexes are cached under qconv_home()/datastores, keyed by the files (path, size, mtime) and the tokenizer."""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qconv.errors import QconvError
from qconv.fsutil import sha256_json
from qconv.paths import qconv_home
from qconv.runtime.spec import alias_key

TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".js", ".ts", ".java",
                 ".go", ".rs", ".rb", ".sh", ".sql", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".html", ".css")
SEPARATOR = -1
MAX_OCCURRENCES = 1024  # continuations looked at per query (evenly spaced over the matches)
INDEX_VERSION = 1


@dataclass
class Datastore:
    tokens: np.ndarray  # int32 [N], documents joined by SEPARATOR
    keys: np.ndarray  # int32 [N]: tokens with aliases applied (what n-grams are matched on)
    order: np.ndarray  # int32 [N]: positions sorted by their first max_ngram keys (stable: ties in text order)
    max_ngram: int = 8
    min_ngram: int = 2
    aliases: dict[int, int] | None = None

    def __len__(self) -> int:
        return int((self.tokens >= 0).sum())

    @classmethod
    def build(cls, docs: list, aliases: dict[int, int] | None = None, max_ngram: int = 8,
              min_ngram: int = 2) -> Datastore:
        if not 1 <= min_ngram <= max_ngram:
            raise QconvError(f"bad datastore n-gram range {min_ngram}..{max_ngram}", fix="need 1 <= min <= max")
        parts = []
        for d in docs:
            parts += [np.asarray(d, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
        tokens = np.concatenate(parts) if parts else np.array([SEPARATOR], dtype=np.int32)
        keys = tokens.copy()
        if aliases:
            src = np.fromiter(aliases.keys(), dtype=np.int64)
            lut = np.arange(max(int(tokens.max()), int(src.max())) + 1, dtype=np.int32)
            lut[src] = np.fromiter(aliases.values(), dtype=np.int32)
            ok = keys >= 0
            keys[ok] = lut[keys[ok]]
        return cls(tokens, keys, _sort_by_prefix(keys, max_ngram), max_ngram, min_ngram, aliases or None)

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi) of the index entries whose first len(pattern) keys equal pattern. Python's list order is the
        index's: a shorter list (a separator is -1, or the end of the array) sorts first."""
        n = len(pattern)

        def prefix(pos) -> list[int]:
            return self.keys[pos:pos + n].tolist()

        return bisect_left(self.order, pattern, key=prefix), bisect_right(self.order, pattern, key=prefix)

    def occurrences(self, seq: list[int], n: int) -> np.ndarray:
        """Continuation start positions of seq's last n tokens (evenly thinned to MAX_OCCURRENCES)."""
        lo, hi = self._range(self.keys_of(seq[len(seq) - n:]))
        occ = self.order[lo:hi]
        if len(occ) > MAX_OCCURRENCES:
            occ = occ[np.linspace(0, len(occ) - 1, MAX_OCCURRENCES).astype(np.int64)]
        return occ.astype(np.int64) + n

    def keys_of(self, tokens: list[int]) -> list[int]:
        return list(alias_key(self.aliases, tokens))

    def candidates(self, seq: list[int], k: int, limit: int) -> list[tuple[list[int], int]]:
        """Up to `limit` continuations (k tokens at most, with the n of their match): for the longest matching
        suffix, then shorter ones, one per distinct first token, most frequent first; each follows the most
        frequent next token among the occurrences that agree with it so far."""
        out: list[tuple[list[int], int]] = []
        seen: set[int] = set()
        if k <= 0:
            return out
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            starts = self.occurrences(seq, n)
            if not len(starts):
                continue
            idx = np.minimum(starts[:, None] + np.arange(k), len(self.tokens) - 1)
            conts = self.tokens[idx]
            conts[np.maximum.accumulate(conts < 0, axis=1)] = SEPARATOR  # nothing past a document's end
            firsts, counts = np.unique(conts[:, 0], return_counts=True)
            for t in firsts[np.argsort(-counts, kind="stable")].tolist():
                if t < 0 or t in seen:
                    continue
                seen.add(t)
                out.append((_modal_path(conts[conts[:, 0] == t], k), n))
                if len(out) >= limit:
                    return out
        return out


def _modal_path(rows: np.ndarray, k: int) -> list[int]:
    """rows [m, k] of continuations sharing their first token: follow the most frequent next token down."""
    path = [int(rows[0, 0])]
    for d in range(1, k):
        if len(rows) == 1:  # one occurrence left: the rest of it, up to its document's end
            rest = rows[0, d:]
            end = np.flatnonzero(rest < 0)
            return path + rest[: end[0] if len(end) else len(rest)].tolist()
        col = rows[:, d]
        counts = Counter(col[col >= 0].tolist())  # a dict beats np.unique's sort on these few rows
        if not counts:
            break
        top = max(counts.values())
        best = min(t for t, c in counts.items() if c == top)  # ties: the smallest token, as before
        path.append(best)
        rows = rows[col == best]
    return path


def _sort_by_prefix(keys: np.ndarray, width: int) -> np.ndarray:
    """Positions sorted by keys[i:i+w] for w the power of two >= width (prefix doubling on ranks; a refinement of
    the order by the first `width` keys, which is all a range query needs), ties in text order, the end first."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = _dense_ranks(keys[order])
    span = 1
    while span < width:
        nxt = np.full(n, -1, dtype=np.int64)
        nxt[:n - span] = rank[span:]
        order = np.lexsort((nxt, rank))
        pair = np.stack([rank[order], nxt[order]], axis=1)
        rank[order] = np.concatenate([[0], np.cumsum(np.any(pair[1:] != pair[:-1], axis=1))])
        span *= 2
    return order.astype(np.int32)


def _dense_ranks(sorted_vals: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sorted_vals[1:] != sorted_vals[:-1])]).astype(np.int64)


def text_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The files a --datastore list names: files as given, directories walked for text/source suffixes."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES and f.is_file())
        else:
            raise QconvError("datastore path not found", where=str(p),
                             fix="pass text files or folders of them (source code, docs, transcripts)")
    if not out:
        raise QconvError("no text files in the datastore paths", where=", ".join(map(str, paths)),
                         fix=f"folders are searched for {' '.join(TEXT_SUFFIXES[:6])} ... files")
    return out


def load_datastore(paths: list[str | os.PathLike], tokenizer, aliases: dict[int, int] | None = None,
                   max_ngram: int = 8, min_ngram: int = 2, cache_dir: Path | None = None) -> Datastore:
    """Tokenize and index the files under `paths`, or load the index cached for the same files and tokenizer."""
    files = text_files(paths)
    vocab = sorted(tokenizer.get_vocab().items())
    key = sha256_json({"v": INDEX_VERSION, "n": [min_ngram, max_ngram], "vocab": vocab,
                       "aliases": sorted((aliases or {}).items()),
                       "files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]})
    cache_dir = Path(cache_dir) if cache_dir is not None else qconv_home() / "datastores"
    cached = cache_dir / f"{key[:32]}.npz"
    if cached.is_file():
        with np.load(cached) as z:
            return Datastore(z["tokens"], z["keys"], z["order"], max_ngram, min_ngram, aliases or None)
    docs = []
    for f in files:
        text = f.read_text(errors="replace")
        if text.strip():
            docs.append(np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32))
    ds = Datastore.build(docs, aliases, max_ngram, min_ngram)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{cached.name}.{os.getpid()}.tmp.npz"
    try:
        np.savez(tmp, tokens=ds.tokens, keys=ds.keys, order=ds.order)
        os.replace(tmp, cached)
    finally:
        tmp.unlink(missing_ok=True)
    return ds
