"""Continuous batching: one thread owns the model and its cache. Requests join between decode steps (prefilled
together into their own slots); each batched forward advances every active slot by its sampled token plus whatever
of its own drafts (spec.py) verify. The HTTP layer submits a `GenRequest` with a thread-safe `emit` callback and
cancels by setting a flag the thread checks every step.

A failure of one request (its seed, sampling, detokenizing) ends only that request; a failing forward ends its
batch; if the thread dies, every request it held fails and `submit` refuses from then on (`SchedulerDown`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qconv.runtime.detok import TextStream
from qconv.runtime.sampling import SamplingParams
from qconv.runtime.spec import Draft, SpecConfig, Speculator, make_speculator, verify
from qconv.serve.metrics import Metrics

log = logging.getLogger(__name__)
# Prompt tokens prefilled in one batch of joining requests (bounds the [rows, T, vocab] logits of that forward).
PREFILL_TOKENS = 2048


class QueueFull(Exception):
    """The waiting queue is at its bound; the server answers 429."""


class SchedulerDown(Exception):
    """The model thread has stopped (shut down or died); the server answers 503."""


@dataclass
class Event:
    """One message from the scheduler to a request's client: new text, and on the last one why it ended."""

    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(eq=False)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # scheduler-side state
    slot: int = -1
    out_ids: list[int] = field(default_factory=list)
    text: TextStream | None = None
    generator: torch.Generator | None = None
    speculator: Speculator | None = None
    first_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 8,
        max_len: int = 2048,
        max_queue: int = 64,
        kv_scheme: str = "bf16",
        spec: SpecConfig = SpecConfig("none"),
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_len, self.max_queue = max_len, max_queue
        self.spec = spec  # each row drafts with its own speculator (spec.py), verified in the batched forward
        self.cache = model.new_cache(max_batch, max_len, kv_scheme)
        self.eos = set(model.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos.add(int(tokenizer.eos_token_id))
        self.metrics = Metrics()
        self.generator = torch.Generator().manual_seed(0)  # requests without a seed share it
        self.waiting: deque[GenRequest] = deque()
        self.active: list[GenRequest] = []
        self.free = list(range(max_batch))
        self.cond = threading.Condition()
        self.stopping = False
        self.died: str | None = None  # why the model thread ended abnormally
        self.thread: threading.Thread | None = None

    def submit(self, req: GenRequest) -> None:
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        if len(req.prompt_ids) + req.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)}) + max_tokens ({req.max_tokens}) > {self.max_len}")
        with self.cond:
            if self.stopping or self.died is not None or (self.thread is not None and not self.thread.is_alive()):
                raise SchedulerDown(self.died or "the scheduler has stopped")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests already waiting (limit {self.max_queue})")
            self.waiting.append(req)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cond.notify()

    def start(self) -> Scheduler:
        self.thread = threading.Thread(target=self._run, name="qconv-scheduler", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _run(self) -> None:
        reason, error = "cancelled", "server shutting down"
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.active:
                        self.cond.wait()
                    if self.stopping:
                        break
                try:
                    self.step()
                except Exception as e:  # a model error fails the batch in flight, never the server
                    log.exception("scheduler step failed")
                    for r in list(self.active):
                        self._finish(r, "error", error=f"{type(e).__name__}: {e}")
        except BaseException as e:  # the thread is dying: nobody will run what it holds
            log.exception("scheduler thread died")
            with self.cond:
                self.died = f"the scheduler thread died ({type(e).__name__}: {e})"
            reason, error = "error", self.died
            raise
        finally:
            with self.cond:
                held = list(self.active) + list(self.waiting)
                self.waiting.clear()
            for r in held:
                with contextlib.suppress(Exception):
                    self._finish(r, reason, error=error)

    def _guard(self, r: GenRequest, fn, *args):
        """fn(*args) for one request; its failure ends that request alone (error event, slot freed), -> None."""
        try:
            return fn(*args)
        except Exception as e:
            log.warning("request failed: %s: %s", type(e).__name__, e)
            with contextlib.suppress(Exception):
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            return None

    def step(self) -> None:
        """One scheduling round: drop cancelled work, admit (prefill) waiting requests into free slots, then one
        batched decode step over every active slot."""
        with self.cond:  # clients that left while queued free their place in the bounded queue
            gone = [r for r in self.waiting if r.cancelled.is_set()]
            for r in gone:
                self.waiting.remove(r)
        for r in gone + [r for r in self.active if r.cancelled.is_set()]:
            self._finish(r, "cancelled")
        joining: list[GenRequest] = []
        budget = PREFILL_TOKENS
        while len(joining) < len(self.free):
            with self.cond:
                if not self.waiting or (joining and len(self.waiting[0].prompt_ids) > budget):
                    break
                r = self.waiting.popleft()
                self.metrics.queue_depth.set(len(self.waiting))
            if r.cancelled.is_set():
                self._finish(r, "cancelled")
                continue
            joining.append(r)
            budget -= len(r.prompt_ids)
        if joining:
            self._prefill(joining)
        if self.active:
            self._decode()
        self.metrics.running.set(len(self.active))

    def _prefill(self, reqs: list[GenRequest]) -> None:
        """Prefill the joining requests together: rows must share T, so feed the shortest remaining prompt length
        to every unfinished row per forward (one forward per distinct prompt length; one, when they match)."""
        for r in reqs:
            r.slot = self.free.pop(0)
            self.active.append(r)
            self.cache.reset([r.slot])
            self._guard(r, self._setup, r)
        reqs = [r for r in reqs if r in self.active]
        if not reqs:
            return
        fed = {id(r): 0 for r in reqs}
        last: dict[int, torch.Tensor] = {}
        hidden: dict[int, list[torch.Tensor]] = {id(r): [] for r in reqs}  # model drafters see every position
        need_hidden = any(r.speculator is not None and r.speculator.needs_hidden for r in reqs)
        while rows := [r for r in reqs if fed[id(r)] < len(r.prompt_ids)]:
            T = min(len(r.prompt_ids) - fed[id(r)] for r in rows)
            tokens = torch.tensor([r.prompt_ids[fed[id(r)] : fed[id(r)] + T] for r in rows], dtype=torch.long)
            out = self.model(tokens, self.cache, torch.tensor([r.slot for r in rows]), return_hidden=need_hidden)
            logits, h = out if need_hidden else (out, None)
            for i, r in enumerate(rows):
                fed[id(r)] += T
                if need_hidden:
                    hidden[id(r)].append(h[i])
                if fed[id(r)] == len(r.prompt_ids):
                    last[id(r)] = logits[i, -1]
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in reqs))
        toks = [self._guard(r, self._first, r, last[id(r)], hidden[id(r)]) if r in self.active else None for r in reqs]
        self._accept(reqs, toks)

    def _first(self, r: GenRequest, logits: torch.Tensor, hidden: list[torch.Tensor]) -> list[int]:
        new = verify(Draft(), logits[None], r.sampling, r.generator or self.generator)
        if r.speculator is not None:
            r.speculator.begin(r.prompt_ids, self.cache, r.slot, torch.cat(hidden) if hidden else None, new[0])
        return new

    def _setup(self, r: GenRequest) -> None:
        if r.seed is not None:
            r.generator = torch.Generator().manual_seed(r.seed)
        r.text = TextStream(self.tokenizer, r.stop)
        r.speculator = make_speculator(self.spec, self.model, r.sampling, r.generator or self.generator)

    def _decode(self) -> None:
        """One batched step. Each row also feeds its own drafts (rows padded to a common T); verification keeps
        the accepted prefix plus the target's next token, and the cache rolls back the rest."""
        batch = list(self.active)
        slots = [r.slot for r in batch]
        before = [int(self.cache.lengths[s]) for s in slots]
        room = self.max_len - max(before) - 1  # every row writes T tokens, so T is bounded by the fullest slot
        drafts = [self._guard(r, self._draft, r, room) or Draft() for r in batch]
        T = 1 + max(map(len, drafts))
        rows = [[r.out_ids[-1], *d.tokens] + [r.out_ids[-1]] * (T - 1 - len(d)) for r, d in zip(batch, drafts)]
        need_hidden = any(r.speculator is not None and r.speculator.needs_hidden for r in batch)
        out = self.model(
            torch.tensor(rows, dtype=torch.long), self.cache, torch.tensor(slots), return_hidden=need_hidden
        )
        logits, hidden = out if need_hidden else (out, None)
        toks = [
            self._guard(r, self._verify, r, d, logits[i, : len(d) + 1], None if hidden is None else hidden[i])
            if r in self.active
            else None
            for i, (r, d) in enumerate(zip(batch, drafts))
        ]
        kept = [(r, b, t) for r, b, t in zip(batch, before, toks) if t is not None]
        if kept and T > 1:
            self.cache.rollback([r.slot for r, _, _ in kept], [b + len(t) for _, b, t in kept])
        self.metrics.draft_tokens.inc(sum(map(len, drafts)))
        self.metrics.accepted_tokens.inc(sum(len(t) - 1 for t in toks if t is not None))
        self.metrics.step(len(batch), sum(len(t) for t in toks if t is not None))
        self._accept(batch, toks)

    def _draft(self, r: GenRequest, room: int) -> Draft:
        if r.speculator is None:
            return Draft()
        return r.speculator.draft(r.prompt_ids + r.out_ids, min(room, r.max_tokens - len(r.out_ids) - 1))

    def _verify(self, r: GenRequest, draft: Draft, logits: torch.Tensor, hidden: torch.Tensor | None) -> list[int]:
        new = verify(draft, logits, r.sampling, r.generator or self.generator)
        if r.speculator is not None:
            r.speculator.verified(draft, new, hidden)
        return new

    def _accept(self, batch: list[GenRequest], toks: list[list[int] | None]) -> None:
        now = time.monotonic()
        for r, new in zip(batch, toks):
            if new is None or r not in self.active:
                continue  # ended on its own error
            self._guard(r, self._take, r, new, now)

    def _take(self, r: GenRequest, new: list[int], now: float) -> None:
        if r.first_token_at is None:
            r.first_token_at = now
            self.metrics.ttft.observe(now - r.arrival)
        for t in new:
            r.out_ids.append(int(t))
            self.metrics.generation_tokens.inc()
            if t in self.eos:
                self._finish(r, "stop")
                return
            text = r.text.push([t])
            if r.text.stopped:
                self._finish(r, "stop", text=text)
                return
            if text:
                self._send(r, Event(text=text))
            if len(r.out_ids) >= r.max_tokens:  # submit keeps prompt + max_tokens within max_len
                self._finish(r, "length")
                return

    def _finish(self, r: GenRequest, reason: str, *, text: str | None = None, error: str | None = None) -> None:
        if r in self.active:
            self.active.remove(r)
            self.cache.reset([r.slot])
            self.free.append(r.slot)
        if text is None:  # an error sends no text: decoding may be what failed
            text = r.text.finish() if r.text is not None and reason != "error" else ""
        self._send(
            r,
            Event(
                text=text,
                finish_reason=reason,
                prompt_tokens=len(r.prompt_ids),
                completion_tokens=len(r.out_ids),
                error=error,
            ),
        )
        self.metrics.finished(reason, time.monotonic() - r.arrival)

    def _send(self, r: GenRequest, ev: Event) -> None:
        try:
            r.emit(ev)
        except RuntimeError:  # the client's event loop is gone: nobody is listening any more
            r.cancel()
