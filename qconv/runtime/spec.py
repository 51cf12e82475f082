"""Drafters for speculative decoding. Each proposes tokens for the positions after the accepted sequence, with a
source tag per token (for acceptance statistics) and its proposal distribution q (None = point mass, i.e. a
deterministic proposal such as prompt lookup). They never change the output: the verifier decides."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from qconv.errors import QconvError
from qconv.runtime.sampling import SamplingParams, probs_from_logits

SPEC_MODES = ("none", "lookup", "mtp", "hybrid")


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, other: Draft) -> Draft:
        return Draft(self.tokens + other.tokens, self.sources + other.sources, self.probs + other.probs)

    def truncate(self, k: int) -> Draft:
        return Draft(self.tokens[:k], self.sources[:k], self.probs[:k])


class PromptLookup:
    """Prompt lookup: find the longest suffix (n from max_ngram down to min_ngram) of the sequence that occurred
    earlier in prompt + output, and propose what followed it. Among several occurrences take the one nearest to
    where the previous match would have continued by now (a copy keeps its place in the source even through
    short, common n-grams), else the most recent. The n-gram index grows with the accepted sequence (one insert
    per n per token), so a proposal costs O(max_ngram) dict lookups, not O(length)."""

    needs_hidden = False

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, aliases: dict[int, int] | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise QconvError(f"bad lookup n-gram range {min_ngram}..{max_ngram}", fix="need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.aliases = aliases or {}  # token -> the token it is matched as (see punctuation_aliases)
        self.begin([])

    def begin(self, prompt: list[int], cache=None, max_len: int = 0) -> None:
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(self.min_ngram,
                                                                                       self.max_ngram + 1)}
        self._indexed = 0  # n-grams ending at positions <= _indexed are in the index
        self._cursor: tuple[int, int] | None = None  # (continuation start, sequence length) of the last match

    def observe(self, hidden, next_tokens) -> None:
        pass

    def _catch_up(self, seq: list[int]) -> None:
        # Index occurrences whose continuation starts at e <= len(seq) - 1 (the suffix itself is not a match).
        if len(seq) - 1 < self._indexed:  # a different, shorter sequence: start over
            self.begin(seq)
        for e in range(self._indexed + 1, len(seq)):
            for n, idx in self._index.items():
                if e >= n:
                    idx.setdefault(self._key(seq[e - n:e]), []).append(e)
        self._indexed = max(self._indexed, len(seq) - 1)

    def _nearest(self, occ: list[int], length: int) -> int:
        if self._cursor is None or len(occ) == 1:
            return occ[-1]
        want = self._cursor[0] + length - self._cursor[1]
        i = bisect_left(occ, want)
        near = occ[max(i - 1, 0):i + 1]
        return min(near, key=lambda e: (abs(e - want), -e))

    def match(self, seq: list[int], extra: list[int] = ()) -> tuple[int, int]:
        """(start of the continuation, n) of the longest matching suffix of seq + extra, or (-1, 0)."""
        self._catch_up(seq)
        ext = seq + list(extra) if extra else seq
        for n in range(min(self.max_ngram, len(ext)), self.min_ngram - 1, -1):
            occ = self._index[n].get(self._key(ext[len(ext) - n:]))
            if occ:
                e = self._nearest(occ, len(ext))
                self._cursor = (e, len(ext))
                return e, n
        return -1, 0

    def propose(self, seq: list[int], k: int, extra: list[int] = (), budget: int | None = None) -> Draft:
        if k <= 0:
            return Draft()
        e, n = self.match(seq, extra)
        if e < 0:
            return Draft()
        src = f"lookup{min(n, 4)}"
        return Draft(_continuation(seq + list(extra), e, k), [src] * k, [None] * k)

    def candidates(self, seq: list[int], k: int, limit: int) -> list[tuple[list[int], int]]:
        """Up to `limit` continuations (k tokens each, with the n of their match) for a token tree: first the
        one `propose` would give, then the other occurrences of the longest matching suffix and of shorter
        ones, most recent first. Duplicates are left to the trie."""
        e, n = self.match(seq)
        if e < 0 or k <= 0:
            return []
        out, seen = [(_continuation(seq, e, k), n)], {e}
        for m in range(n, self.min_ngram - 1, -1):
            for e2 in reversed(self._index[m].get(self._key(seq[len(seq) - m:]), ())):
                if len(out) >= limit:
                    return out
                if e2 not in seen:
                    seen.add(e2)
                    out.append((_continuation(seq, e2, k), m))
        return out

    def normalized(self, tokens: list[int]) -> list[int]:
        """tokens with every alias replaced by its canonical token (how a model that normalizes them writes)."""
        return list(alias_key(self.aliases, tokens))

    def _key(self, ngram: list[int]) -> tuple[int, ...]:
        return alias_key(self.aliases, ngram)


def alias_key(aliases: dict[int, int] | None, ngram) -> tuple[int, ...]:
    """An n-gram as matched: every alias replaced by its canonical token (see punctuation_aliases)."""
    return tuple(aliases.get(t, t) for t in ngram) if aliases else tuple(ngram)


class History:
    """Cross-request n-gram memory (as in suffix decoding): the prompts and outputs of earlier requests, so a
    request's token tree can also try what other requests wrote after the same n-gram (code idioms, boilerplate,
    a template's phrasing). Only n >= min_ngram (2) matches, since other texts' single tokens are mostly noise.
    Bounded: past max_tokens the oldest sequences are dropped. Lossless like every drafter: the target verifies."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, max_tokens: int = 1 << 20,
                 aliases: dict[int, int] | None = None):
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.aliases = aliases or {}
        self.seqs: dict[int, list[int]] = {}
        self._next = 0
        self._tokens = 0  # sum of len(seq) over seqs
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        return self._tokens

    def add(self, tokens: list[int]) -> None:
        sid, self._next = self._next, self._next + 1
        self.seqs[sid] = list(tokens)
        self._tokens += len(tokens)
        self._index_seq(sid)
        if self._tokens > self.max_tokens:
            while self._tokens > self.max_tokens and len(self.seqs) > 1:
                self._tokens -= len(self.seqs.pop(min(self.seqs)))
            self._index = {}
            for i in self.seqs:
                self._index_seq(i)

    def _index_seq(self, sid: int) -> None:
        seq = self.seqs[sid]
        for e in range(1, len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                self._index.setdefault(self._key(seq[e - n:e]), []).append((sid, e))

    def candidates(self, seq: list[int], k: int, limit: int) -> list[tuple[list[int], int]]:
        """Up to `limit` distinct continuations (at most k tokens, with their n) of seq's longest suffixes."""
        out: list[tuple[list[int], int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            for sid, e in reversed(self._index.get(self._key(seq[len(seq) - n:]), ())):
                cont = self.seqs[sid][e:e + k]
                if cont and tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    out.append((cont, n))
                    if len(out) >= limit:
                        return out
        return out

    def _key(self, ngram: list[int]) -> tuple[int, ...]:
        return alias_key(self.aliases, ngram)


def _continuation(ext: list[int], e: int, k: int) -> list[int]:
    """k tokens from ext[e]; past the end of the sequence the match repeats with period len(ext) - e."""
    out: list[int] = []
    for j in range(k):
        i = e + j
        out.append(ext[i] if i < len(ext) else out[i - len(ext)])
    return out


class MTPDrafter:
    """qwen3_5 multi-token prediction: the MTP layer takes the target's hidden state at position t and the
    embedding of token t+1 and predicts token t+2; chained on its own hidden state for k drafts. Its KV cache
    holds one entry per accepted position (fed from the target's hidden states after every step); chained draft
    entries are rolled back after proposing."""

    needs_hidden = True

    def __init__(self, model, k: int = 4, params: SamplingParams = SamplingParams(),
                 generator: torch.Generator | None = None):
        if getattr(model, "mtp", None) is None:
            raise QconvError("this model has no MTP head", fix="use --spec lookup, or a qwen3_5 checkpoint with mtp.*")
        self.model, self.k, self.params, self.generator = model, k, params, generator
        self.cache = None
        self._logits: torch.Tensor | None = None  # MTP logits for the token after the next one
        self._hidden: torch.Tensor | None = None

    def begin(self, prompt: list[int], cache=None, max_len: int = 0) -> None:
        own = getattr(cache, "mtp", None)  # the target cache may carry the MTP head's cache
        self.cache = own if own is not None else self.model.mtp.new_cache(1, max_len)
        self._logits = self._hidden = None

    def observe(self, hidden: torch.Tensor, next_tokens: list[int]) -> None:
        """hidden[T, H]: target states at the newly accepted positions; next_tokens: the token after each."""
        nxt = torch.tensor([next_tokens], dtype=torch.long, device=hidden.device)
        logits, h = self.model.mtp(hidden[None], nxt, self.cache)
        self._logits, self._hidden = logits[0, -1], h[0, -1:]

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.params.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits, self.params.temperature, self.params.top_p, self.params.top_k)
        return int(torch.multinomial(q, 1, generator=self.generator)), q

    @torch.no_grad()
    def propose(self, seq: list[int], k: int, extra: list[int] = (), budget: int | None = None) -> Draft:
        """Up to min(k, self.k, budget) chained drafts; `budget` lets the controller skip drafts it won't verify."""
        k = min(k, self.k, self.k if budget is None else budget)
        if k <= 0 or self._logits is None:
            return Draft()
        keep = self.cache.lengths[:1].clone()
        draft = Draft()
        logits, hidden = self._logits, self._hidden
        for i in range(k):
            tok, q = self._pick(logits)
            draft = draft.extend(Draft([tok], ["mtp"], [q]))
            if i + 1 < k:
                nxt = torch.tensor([[tok]], dtype=torch.long, device=hidden.device)
                out, h = self.model.mtp(hidden[None], nxt, self.cache)
                logits, hidden = out[0, -1], h[0, -1:]
        self.cache.rollback(torch.zeros(1, dtype=torch.long), keep)
        return draft


class HybridDrafter:
    """A model drafter's own k tokens, then prompt lookup (matched over sequence + those drafts) fills the block."""

    needs_hidden = True

    def __init__(self, drafter, lookup: PromptLookup):
        self.drafter, self.lookup = drafter, lookup

    def begin(self, prompt: list[int], cache=None, max_len: int = 0) -> None:
        self.drafter.begin(prompt, cache, max_len)
        self.lookup.begin(prompt, cache, max_len)

    def observe(self, hidden, next_tokens) -> None:
        self.drafter.observe(hidden, next_tokens)

    def propose(self, seq: list[int], k: int, extra: list[int] = (), budget: int | None = None) -> Draft:
        head = self.drafter.propose(seq, k, budget=budget)
        return head.extend(self.lookup.propose(seq, k - len(head), extra=head.tokens))


CLOSING_PUNCTUATION = set(",.;:!?)]}")


def punctuation_aliases(tokenizer) -> dict[int, int]:
    """Space-prefixed closing punctuation tokens -> the same punctuation without the space (" ," -> ","), for tokenizers
    that mark a leading space in the token string (byte-level BPE "Ġ", sentencepiece "▁"). Text such as
    wikitext spaces its punctuation ("film , television") and a model copying it writes "film, television":
    matching n-grams modulo these aliases keeps the copy's place, and token trees also propose the normalized
    form. Both forms are always verified by the target, so aliases change speed, never output."""
    vocab = tokenizer.get_vocab()
    out = {}
    for text, i in vocab.items():
        if text[:1] in ("Ġ", "▁") and len(text) > 1:
            rest = text[1:]
            if rest in vocab and all(c in CLOSING_PUNCTUATION for c in rest):
                out[i] = vocab[rest]
    return out


def make_drafter(mode: str, model, params: SamplingParams, generator: torch.Generator | None = None, *,
                 mtp_k: int = 4, max_ngram: int = 4, min_ngram: int = 1, aliases: dict[int, int] | None = None):
    """The drafter for a --spec mode (None for "none")."""
    if mode not in SPEC_MODES:
        raise QconvError(f"unknown speculative mode {mode!r}", fix=f"one of {', '.join(SPEC_MODES)}")
    if mode == "none":
        return None
    if mode == "lookup":
        return PromptLookup(max_ngram, min_ngram, aliases)
    mtp = MTPDrafter(model, mtp_k, params, generator)
    return mtp if mode == "mtp" else HybridDrafter(mtp, PromptLookup(max_ngram, min_ngram, aliases))
