"""Continuous batching: one thread owns the model and its cache. Requests join between decode steps into their own
slots; their prompts are prefilled a chunk (`prefill_chunk` tokens, all joining rows together) per step, between the
decode steps of the others, so a long prompt delays the running requests and a short newcomer by one chunk, not by
its whole prefill (as vLLM's chunked prefill). Each batched forward (engine/batch.py, the engine's one decode loop) advances every
active slot by its sampled token plus whatever of its own drafts (spec.py) verify. The HTTP layer submits a `GenRequest` with a thread-safe `emit` callback and
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

from qconv.engine.batch import Prefill, decode
from qconv.engine.detok import TextStream
from qconv.engine.sampling import SamplingParams
from qconv.engine.spec import SpecConfig, Speculator, make_speculator
from qconv.serve.metrics import Metrics

log = logging.getLogger(__name__)
# Prompt tokens prefilled per scheduler step, over every joining request (bounds that forward's work and its
# [rows, T, vocab] logits, and so how long the running requests wait for their next token)
PREFILL_CHUNK = 256


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
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.prefill_chunk = prefill_chunk
        self.prefilling = Prefill()  # requests with a slot whose prompt is not yet whole
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
                    while not self.stopping and not self.waiting and not self.active and not self.prefilling.rows:
                        self.cond.wait()
                    if self.stopping:
                        break
                try:
                    self.step()
                except Exception as e:  # a model error fails the batch in flight, never the server
                    log.exception("scheduler step failed")
                    for r in self._held():
                        self._finish(r, "error", error=f"{type(e).__name__}: {e}")
        except BaseException as e:  # the thread is dying: nobody will run what it holds
            log.exception("scheduler thread died")
            with self.cond:
                self.died = f"the scheduler thread died ({type(e).__name__}: {e})"
            reason, error = "error", self.died
            raise
        finally:
            with self.cond:
                held = self._held() + list(self.waiting)
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

    def _held(self) -> list[GenRequest]:
        return list(self.active) + list(self.prefilling.rows)

    def step(self) -> None:
        """One scheduling round: drop cancelled work, give waiting requests free slots, feed one chunk of the
        joining prompts, then one batched decode step over every active slot."""
        with self.cond:  # clients that left while queued free their place in the bounded queue
            gone = [r for r in self.waiting if r.cancelled.is_set()]
            for r in gone:
                self.waiting.remove(r)
        for r in gone + [r for r in self._held() if r.cancelled.is_set()]:
            self._finish(r, "cancelled")
        while self.free:
            with self.cond:
                if not self.waiting:
                    break
                r = self.waiting.popleft()
                self.metrics.queue_depth.set(len(self.waiting))
            if r.cancelled.is_set():
                self._finish(r, "cancelled")
                continue
            self._join(r)
        if self.prefilling.rows:
            self._prefill()
        if self.active:
            self._decode()
        self.metrics.running.set(len(self.active) + len(self.prefilling.rows))

    def _join(self, r: GenRequest) -> None:
        """A slot for the request, and its prompt queued for prefill (batch.Prefill)."""
        r.slot = self.free.pop(0)
        self.cache.reset([r.slot])
        self.prefilling.add([r])
        self._guard(r, self._setup, r)

    def _prefill(self) -> None:
        """One chunk of the joining prompts; the requests whose prompt is now whole sample their first token and
        decode from the next step on."""
        fed, done = self.prefilling.step(self.model, self.cache, self._guard, self.prefill_chunk)
        self.metrics.prompt_tokens.inc(fed)
        done = [(r, new) for r, new in done if new is not None]  # the others ended on their own error
        self.active.extend(r for r, _ in done)
        self._accept([r for r, _ in done], [new for _, new in done])

    def _setup(self, r: GenRequest) -> None:
        r.generator = torch.Generator().manual_seed(r.seed) if r.seed is not None else self.generator
        r.text = TextStream(self.tokenizer, r.stop)
        r.speculator = make_speculator(self.spec, self.model, r.sampling, r.generator)

    def _decode(self) -> None:
        """One batched step over every active slot (batch.decode), then the metrics and each row's new tokens."""
        batch = list(self.active)
        drafts, toks = decode(self.model, self.cache, batch, self.max_len, self._guard)
        self.metrics.drafts.inc(sum(1 for d in drafts if len(d)))
        self.metrics.draft_tokens.inc(sum(map(len, drafts)))
        self.metrics.accepted_tokens.inc(sum(len(t) - 1 for t in toks if t is not None))
        self.metrics.step(len(batch), sum(len(t) for t in toks if t is not None))
        self._accept(batch, toks)

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
        if r in self.active or r in self.prefilling.rows:
            if r in self.active:
                self.active.remove(r)
            self.prefilling.drop(r)
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
