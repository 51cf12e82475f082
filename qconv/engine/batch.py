"""The prefill and the decode step of our engine, over a batch of rows: the one decode loop that `qconv generate`
(engine/generate.py, one row) and `qconv serve` (serve/scheduler.py, continuous batching) both drive.

A row is anything with the attributes of `Sequence`. Each decode step feeds every row its last token plus its own
drafts (spec.py), padded to a common length; verification keeps the accepted prefix and the target's next token,
and the cache rolls back the rest. `guard(row, fn, *args)` runs each row's own work (sampling, drafting): the
default lets an error propagate; the server's ends only that row and returns None."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qconv.engine.sampling import SamplingParams
from qconv.engine.spec import Draft, Speculator, verify


@dataclass(eq=False)
class Sequence:
    """One request's state in the engine: its prompt, what it generated, and how it samples and drafts."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    speculator: Speculator | None = None
    slot: int = 0
    out_ids: list[int] = field(default_factory=list)


def call(row, fn: Callable, *args):
    return fn(*args)


def _forward(model, cache, rows, tokens: list[list[int]], need_hidden: bool):
    x = torch.tensor(tokens, dtype=torch.long, device=getattr(model, "device", None))
    out = model(x, cache, [r.slot for r in rows], return_hidden=need_hidden)
    return out if need_hidden else (out, None)


def _needs_hidden(rows) -> bool:
    return any(r.speculator is not None and r.speculator.needs_hidden for r in rows)


class Prefill:
    """Prompts being fed into their (reset) slots, one forward per `step`. The server bounds each step by a token
    budget and runs a decode step between them (chunked prefill), so one long prompt delays the other requests by a
    chunk, not by its whole prefill; `prefill` runs it unbounded to the end."""

    def __init__(self, rows=()):
        self.rows: list = []
        self.fed: dict[int, int] = {}
        self.hidden: dict[int, list[torch.Tensor]] = {}  # model drafters see every prompt position
        self.add(rows)

    def add(self, rows) -> None:
        for r in rows:
            self.rows.append(r)
            self.fed[id(r)], self.hidden[id(r)] = 0, []

    def drop(self, r) -> None:
        if r in self.rows:
            self.rows.remove(r)
            del self.fed[id(r)], self.hidden[id(r)]

    def step(self, model, cache, guard: Callable = call, budget: int | None = None) -> tuple[int, list[tuple]]:
        """One forward over every row still feeding. Rows must share T: T is the shortest remaining prompt, and at
        most budget // rows (at least 1). -> (tokens fed, [(row, its first tokens, or None if its own work failed)]
        for the rows whose prompt is now whole)."""
        rows = list(self.rows)
        T = min(len(r.prompt_ids) - self.fed[id(r)] for r in rows)
        if budget is not None:
            T = max(1, min(T, budget // len(rows)))
        need_hidden = _needs_hidden(rows)
        chunks = [r.prompt_ids[self.fed[id(r)] : self.fed[id(r)] + T] for r in rows]
        logits, h = _forward(model, cache, rows, chunks, need_hidden)
        done = []
        for i, r in enumerate(rows):
            self.fed[id(r)] += T
            if need_hidden:
                self.hidden[id(r)].append(h[i])
            if self.fed[id(r)] == len(r.prompt_ids):  # a guard that ends the row drops it itself: still held here
                done.append((r, guard(r, _first, cache, r, logits[i, -1], self.hidden[id(r)])))
                self.drop(r)
        return T * len(rows), done


def prefill(model, cache, rows: list, guard: Callable = call) -> list[list[int] | None]:
    """Feed every row's prompt into its (reset) slot and sample its first token (each forward feeds the shortest
    remaining prompt length to every unfinished row: one forward when they match)."""
    p, first = Prefill(rows), {}
    while p.rows:
        for r, new in p.step(model, cache, guard)[1]:
            first[id(r)] = new
    return [first[id(r)] for r in rows]


def _first(cache, r, logits: torch.Tensor, hidden: list[torch.Tensor]) -> list[int]:
    new = verify(Draft(), logits[None], r.sampling, r.generator)
    if r.speculator is not None:
        r.speculator.begin(r.prompt_ids, cache, r.slot, torch.cat(hidden) if hidden else None, new[0])
    return new


def decode(
    model, cache, rows: list, max_len: int, guard: Callable = call
) -> tuple[list[Draft], list[list[int] | None]]:
    """One batched step -> (each row's draft, each row's new tokens: the accepted drafts and the target's next
    one; None for a row whose own work failed). `max_len`: the cache's length per slot, which bounds the drafts."""
    before = [int(cache.lengths[r.slot]) for r in rows]
    room = max_len - max(before) - 1  # every row writes T tokens, so T is bounded by the fullest slot
    drafts = [guard(r, _draft, r, room) for r in rows]
    drafts_fed = [d or Draft() for d in drafts]
    T = 1 + max(map(len, drafts_fed))
    tokens = [[r.out_ids[-1], *d.tokens] + [r.out_ids[-1]] * (T - 1 - len(d)) for r, d in zip(rows, drafts_fed)]
    logits, hidden = _forward(model, cache, rows, tokens, _needs_hidden(rows))
    toks = [
        None if d is None else guard(r, _verify, r, d, logits[i, : len(d) + 1], None if hidden is None else hidden[i])
        for i, (r, d) in enumerate(zip(rows, drafts))
    ]
    kept = [(r, b, t) for r, b, t in zip(rows, before, toks) if t is not None]
    if kept and T > 1:
        cache.rollback([r.slot for r, _, _ in kept], [b + len(t) for _, b, t in kept])
    return drafts_fed, toks


def _draft(r, room: int) -> Draft:
    if r.speculator is None:
        return Draft()
    return r.speculator.draft(r.prompt_ids + r.out_ids, min(room, r.max_tokens - len(r.out_ids) - 1))


def _verify(r, draft: Draft, logits: torch.Tensor, hidden: torch.Tensor | None) -> list[int]:
    new = verify(draft, logits, r.sampling, r.generator, r.out_ids)
    if r.speculator is not None:
        r.speculator.verified(draft, new, hidden)
    return new
