"""Speculative decoding for every driver (`generate`, the batched scheduler): a `Drafter` proposes tokens,
`verify` accepts a prefix of them losslessly, `DraftLength` picks how many to draft from one acceptance EMA."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from qconv.artifact import Artifact
from qconv.engine.sampling import SamplingParams, penalize, probs_from_logits, verify_greedy, verify_sampling
from qconv.errors import QconvError
from qconv.recipes.sections import Speculative

SPEC_MODES = ("none", "lookup", "mtp", "hybrid")
SURE_RUN = 2  # prompt lookup drafts the whole block on a match this long (PromptLookup)


@dataclass
class Draft:
    """Proposed tokens and, per token, the drafter's distribution q (None = a point mass, as prompt lookup)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def __add__(self, other: Draft) -> Draft:
        return Draft(self.tokens + other.tokens, self.probs + other.probs)


class Drafter(Protocol):
    """`begin` once per sequence; `observe` the tokens each verify accepted (with the target's hidden states at
    those positions if `needs_hidden`, else None); `propose(seq, k, most)`: k tokens to follow seq, up to `most`
    when the drafter is sure."""

    needs_hidden: bool

    def begin(self, prompt: list[int], cache, slot: int) -> None: ...
    def observe(self, hidden: torch.Tensor, next_tokens: list[int]) -> None: ...
    def propose(self, seq: list[int], k: int, most: int | None = None) -> Draft: ...


@dataclass(frozen=True)
class SpecConfig:
    """`method` (none | lookup | mtp | hybrid), the MTP head's chained drafts `k`, the most draft tokens verified
    per step `max_block` (hybrid: lookup fills it past the MTP drafts once they were fully accepted
    `after_saturated` steps running), prompt lookup's n-gram range, and whether the draft length follows the
    acceptance EMA (`adaptive`)."""

    method: str = "lookup"
    k: int = 4
    max_block: int = 15
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True
    after_saturated: int = 0

    def __post_init__(self):
        if self.method not in SPEC_MODES:
            raise QconvError(f"unknown speculative method {self.method!r}", fix=f"one of {', '.join(SPEC_MODES)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise QconvError(
                f"bad lookup n-gram range {self.ngram_min}..{self.ngram_max}", fix="need 1 <= ngram_min <= ngram_max"
            )
        if not 0 <= self.max_block <= 15 or self.k < 0 or self.after_saturated < 0:
            raise QconvError(
                f"bad draft sizes k={self.k}, max_block={self.max_block}",
                fix="need k >= 0, 0 <= max_block <= 15 and after_saturated >= 0",
            )

    @property
    def on(self) -> bool:
        return self.method != "none" and self.max_block > 0

    @classmethod
    def from_manifest(cls, spec: Speculative | None, tokens: int | None = None) -> SpecConfig:
        """The artifact's typed `speculative` block as the engine runs it (None: the artifact records none);
        `tokens` overrides its k (the lookup block for method lookup; 0 = off). Methods our engine lacks (dflash:
        vLLM's) fall back to lookup."""
        if spec is None:
            return cls("none")
        method = "lookup" if spec.method == "dflash" else spec.method
        k = spec.num_speculative_tokens if tokens is None else int(tokens)
        block = k if tokens is not None and method == "lookup" else spec.lookup.max_block
        return cls(
            method="none" if k == 0 else method,
            k=k,
            max_block=min(max(block, k), 15),
            ngram_min=spec.lookup.ngram_min,
            ngram_max=spec.lookup.ngram_max,
            after_saturated=spec.lookup.after_saturated,
        )

    @classmethod
    def of_artifact(cls, path: Path, tokens: int | None = None) -> SpecConfig:
        """`from_manifest` of the folder's qconv.json; prompt lookup (2..4-grams) for a folder without one."""
        art = Artifact.find(path)
        if art is None:
            return cls("lookup") if tokens is None else cls.from_manifest(Speculative("lookup"), tokens)
        return cls.from_manifest(art.speculative, tokens)

    def for_model(self, model) -> SpecConfig:
        """This config on `model`: the MTP part dropped (prompt lookup kept) when the model has no MTP head."""
        if self.method in ("mtp", "hybrid") and getattr(model, "mtp", None) is None:
            return replace(self, method="lookup")
        return self


@dataclass
class DraftLength:
    """Whether to draft, from one EMA of the per-token acceptance rate: the whole block while the rate stays above
    `cost` (a verified token's price relative to a decode step), else nothing. All or nothing because accepted
    drafts come in runs (once a copy is found it goes on) and a verify forward's price is mostly fixed (on a CPU,
    1 -> 2 tokens costs more than 2 -> 16), so a shorter block saves little and cuts the runs short.
    `adaptive=False`: always the most."""

    most: int
    adaptive: bool = True
    cost: float = 0.15
    rate: float = 0.5
    memory: float = 0.8

    def __call__(self) -> int:
        return self.most if not self.adaptive or self.rate > self.cost else 0

    def update(self, drafted: int, accepted: int) -> None:
        """One verified chain: `accepted` of `drafted` draft tokens (a rejection is one more trial)."""
        if drafted:
            trials = accepted + (accepted < drafted)
            self.rate = self.memory * self.rate + (1 - self.memory) * accepted / trials


class PromptLookup:
    """Propose what followed the longest suffix (ngram_max down to ngram_min tokens) of the sequence that occurred
    earlier in it. Of several occurrences take the one nearest to where the previous match would have continued by
    now (a copy keeps its place through short, common n-grams), else the first (an answer echoes a prompt from its
    start: a code fence the prompt opens also closes it, right before the prompt's tail). The n-gram index grows
    with the sequence, so a proposal costs O(ngram_max) dict lookups plus the checks below.

    A sure match is drafted to `most` tokens whatever the acceptance EMA asks: one whose occurrence agrees with the
    sequence's last `sure` tokens or more (a copy in progress), or whose occurrences all go on with the same token.
    The unsure rest, a single token seen before with different continuations, is what the EMA gates: on SmolLM2's
    outputs (bench/spec_bench.py) its first draft token is accepted in 8% of steps on chat, 13% on code and 23% on
    copy, a sure match's in 33%, 37% and 75%."""

    needs_hidden = False

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, sure: int = SURE_RUN):
        self.ngram_min, self.ngram_max, self.sure = ngram_min, ngram_max, sure
        self.begin([])

    def begin(self, prompt: list[int], cache=None, slot: int = 0) -> None:
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams whose continuation starts at positions <= _indexed are in the index
        self._cursor: tuple[int, int] | None = None  # (continuation start, sequence length) of the last match

    def observe(self, hidden, next_tokens) -> None:
        pass

    def _catch_up(self, seq: list[int]) -> None:
        if len(seq) - 1 < self._indexed:  # a different, shorter sequence: start over
            self.begin(seq)
        for e in range(self._indexed + 1, len(seq)):  # the suffix itself (e = len(seq)) is no match
            for n in range(self.ngram_min, min(self.ngram_max, e) + 1):
                self._index.setdefault(tuple(seq[e - n : e]), []).append(e)
        self._indexed = max(self._indexed, len(seq) - 1)

    def _nearest(self, occ: list[int], length: int) -> int:
        if self._cursor is None or len(occ) == 1:
            return occ[0]
        want = self._cursor[0] + length - self._cursor[1]
        i = bisect_left(occ, want)
        return min(occ[max(i - 1, 0) : i + 1], key=lambda e: (abs(e - want), -e))

    def _run(self, seq: list[int], e: int, n: int) -> int:
        """How many tokens before seq's end agree with those before e (at least n; counted up to `sure`)."""
        run = n
        while run < self.sure and run < e and seq[e - 1 - run] == seq[len(seq) - 1 - run]:
            run += 1
        return run

    def _is_sure(self, seq: list[int], occ: list[int], e: int, n: int) -> bool:
        if self._run(seq, e, n) >= self.sure:
            return True
        return all(seq[o] == seq[e] for o in occ)  # occurrences are continuation starts, all < len(seq)

    def propose(self, seq: list[int], k: int, most: int | None = None) -> Draft:
        self._catch_up(seq)
        if k <= 0:
            return Draft()
        for n in range(min(self.ngram_max, len(seq)), self.ngram_min - 1, -1):
            occ = self._index.get(tuple(seq[len(seq) - n :]))
            if occ:
                e = self._nearest(occ, len(seq))
                self._cursor = (e, len(seq))
                if most is not None and most > k and self._is_sure(seq, occ, e, n):
                    k = most
                out: list[int] = []
                for j in range(k):  # past the end of the sequence the match repeats with period len(seq) - e
                    out.append(seq[e + j] if e + j < len(seq) else out[e + j - len(seq)])
                return Draft(out, [None] * k)
        return Draft()


class MTPDrafter:
    """qwen3_5 multi-token prediction: from the target's hidden state at t and token t+1 the MTP layer predicts
    t+2, chained on its own hidden state for up to k drafts. Its cache (the target cache's `.mtp`, same slot) holds
    one entry per accepted position; the chained entries are rolled back after proposing."""

    needs_hidden = True

    def __init__(
        self, model, k: int, params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None
    ):
        if getattr(model, "mtp", None) is None:
            raise QconvError("this model has no MTP head", fix="use --spec lookup, or a qwen3_5 checkpoint with mtp.*")
        self.model, self.k, self.params, self.generator = model, k, params, generator
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None  # MTP logits and hidden for the next draft

    def begin(self, prompt: list[int], cache, slot: int = 0) -> None:
        self.cache, self.slot, self._next = cache, slot, None

    def observe(self, hidden: torch.Tensor, next_tokens: list[int]) -> None:
        """hidden[T, H]: states at the newly accepted positions (target's, or the head's own when chaining);
        next_tokens: the token after each."""
        nxt = torch.tensor([next_tokens], dtype=torch.long, device=hidden.device)
        logits, h = self.model.mtp(hidden[None], nxt, self.cache, slots=[self.slot])
        self._next = logits[0, -1], h[0, -1:]

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.params.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits, self.params.temperature, self.params.top_p, self.params.top_k)
        return int(torch.multinomial(q, 1, generator=self.generator)), q

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, most: int | None = None) -> Draft:
        k = min(k, self.k)
        if k <= 0 or self._next is None:
            return Draft()
        mtp = self.cache.mtp
        keep, saved = int(mtp.lengths[self.slot]), self._next
        draft = Draft()
        for i in range(k):
            tok, q = self._pick(self._next[0])
            draft += Draft([tok], [q])
            if i + 1 < k:
                self.observe(self._next[1], [tok])
        mtp.rollback([self.slot], [keep])
        self._next = saved
        return draft


class HybridDrafter:
    """A model drafter's own k tokens, then prompt lookup (matched over sequence + those drafts) stretches the block
    once the drafter's proposals were accepted whole `after_saturated` steps running (0: every step); a step the
    drafter proposes nothing, lookup drafts alone."""

    needs_hidden = True

    def __init__(self, model: MTPDrafter, lookup: PromptLookup, after_saturated: int = 0):
        self.model, self.lookup, self.after_saturated = model, lookup, after_saturated
        self.needs_hidden = model.needs_hidden
        self._head: list[int] = []
        self.streak = 0  # steps running whose drafter proposal was accepted whole

    def begin(self, prompt: list[int], cache, slot: int = 0) -> None:
        self.model.begin(prompt, cache, slot)
        self.lookup.begin(prompt, cache, slot)
        self._head, self.streak = [], 0

    def observe(self, hidden, next_tokens) -> None:
        """After a verify, next_tokens = the accepted drafts + the target's token: did the drafter's part survive?"""
        if self._head:
            self.streak = self.streak + 1 if next_tokens[: len(self._head)] == self._head else 0
            self._head = []
        self.model.observe(hidden, next_tokens)

    def propose(self, seq: list[int], k: int, most: int | None = None) -> Draft:
        head = self.model.propose(seq, k)
        self._head = head.tokens
        if not head:
            return self.lookup.propose(seq, k, most)
        if self.streak < self.after_saturated:
            return head
        return head + self.lookup.propose(seq + head.tokens, k - len(head), None if most is None else most - len(head))


@dataclass
class Speculator:
    """One sequence's drafter and draft length (a `generate` call, a scheduler row). A step that drafts nothing
    still scores the drafter's first token, so the EMA recovers when the text turns copyable."""

    drafter: Drafter
    length: DraftLength
    _probe: list[int] = field(default_factory=list)

    @property
    def needs_hidden(self) -> bool:
        return self.drafter.needs_hidden

    def begin(self, prompt: list[int], cache, slot: int, hidden: torch.Tensor | None, first: int) -> None:
        """After prefill: hidden[len(prompt), H] (model drafters) and the first token it produced."""
        self.drafter.begin(prompt, cache, slot)
        if self.needs_hidden:
            self.drafter.observe(hidden, prompt[1:] + [first])

    def draft(self, seq: list[int], room: int) -> Draft:
        """The draft to verify after seq, at most `room` tokens."""
        want = min(self.length(), room)
        full = self.drafter.propose(seq, max(want, 1), min(self.length.most, room)) if room > 0 else Draft()
        self._probe = full.tokens[:1] if want < 1 and len(full) <= 1 else []
        return full if want >= 1 or len(full) > 1 else Draft()

    def verified(self, draft: Draft, new: list[int], hidden: torch.Tensor | None) -> None:
        """new = the accepted drafts + the target's token; hidden[>= len(new), H] of that forward."""
        if draft:
            self.length.update(len(draft), len(new) - 1)
        elif self._probe:
            self.length.update(1, int(self._probe == new[:1]))
        self.drafter.observe(hidden[: len(new)] if self.needs_hidden else None, new)


def make_speculator(
    spec: SpecConfig, model, params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None
) -> Speculator | None:
    if not spec.on:
        return None
    lookup = PromptLookup(spec.ngram_min, spec.ngram_max)
    if spec.method == "lookup":
        drafter = lookup
    else:
        mtp = MTPDrafter(model, spec.k, params, generator)
        drafter = mtp if spec.method == "mtp" else HybridDrafter(mtp, lookup, spec.after_saturated)
    return Speculator(drafter, DraftLength(spec.max_block, spec.adaptive))


def verify(
    draft: Draft,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    generated: list[int] | None = None,
) -> list[int]:
    """The accepted drafts plus the target's next token, from logits[len(draft) + 1, V] scored at the last accepted
    token and each draft: greedy prefix match, or rejection sampling (distributed exactly as plain sampling).
    `generated`: the tokens generated so far, for the repetition penalties."""
    if params.penalized:
        logits = penalize(logits, generated or [], draft.tokens, params)
    if params.greedy:
        n, nxt = verify_greedy(draft.tokens, logits)
    else:
        p = probs_from_logits(logits, params.temperature, params.top_p, params.top_k)
        n, nxt = verify_sampling(draft.tokens, draft.probs, p, generator)
    return draft.tokens[:n] + [nxt]
