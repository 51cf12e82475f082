"""The continuous-batching scheduler on the runtime model API, without HTTP: batched requests produce what they
produce alone, prompt-lookup speculation (drafts, verification, cache rollback incl. Gated-DeltaNet state) changes
nothing in greedy output, and the queue bound holds."""

from __future__ import annotations

import threading

import pytest

from qconv.runtime.sampling import SamplingParams
from qconv.serve.scheduler import GenRequest, QueueFull, Scheduler

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "def add(a, b):\n    return a + b\n\n",
           "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First", "0123456789"]


def _run(sched: Scheduler, prompts: list[str], max_tokens: int = 24, **kw) -> list[tuple[list[int], str]]:
    """Submit all prompts at once; (token ids, finish reason) per prompt once every one has finished."""
    done, lock, out = threading.Event(), threading.Lock(), {}

    def sink(i):
        def emit(ev):
            if ev.finish_reason:
                with lock:
                    out[i] = ev.finish_reason
                    if len(out) == len(prompts):
                        done.set()
        return emit

    reqs = [GenRequest(sched.tokenizer(p).input_ids, max_tokens, sink(i), **kw) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    assert done.wait(300), "requests did not finish"
    return [(r.out_ids, out[i]) for i, r in enumerate(reqs)]


def _scheduler(path, **kw) -> Scheduler:
    from qconv.runtime.loader import load_model, load_tokenizer

    return Scheduler(load_model(path, max_batch=4), load_tokenizer(path), max_batch=4, max_len=256, **kw).start()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_batched_and_speculative_greedy_equal_alone(tiny_models, family):
    path = tiny_models(family)
    plain = _scheduler(path)
    try:
        alone = [_run(plain, [p])[0] for p in PROMPTS]
        together = _run(plain, PROMPTS)
    finally:
        plain.stop()
    assert together == alone
    spec = _scheduler(path, spec_tokens=4)
    try:
        drafted = _run(spec, PROMPTS)
    finally:
        spec.stop()
    assert drafted == alone
    m = spec.metrics
    assert m.draft_tokens > 0  # lookup found something to propose in these repetitive prompts
    assert 0 <= m.accepted_tokens <= m.draft_tokens
    assert m.step_tokens == m.generation_tokens - len(PROMPTS)  # prefill makes each request's first token
    assert sorted(plain.free) == sorted(spec.free) == list(range(4))  # every slot came back


def test_seeded_sampling_independent_of_batch(tiny_qwen3):
    sched = _scheduler(tiny_qwen3, spec_tokens=3)
    try:
        kw = dict(sampling=SamplingParams(temperature=0.9, top_p=0.95), seed=11)
        alone = _run(sched, PROMPTS[:1], **kw)[0]
        with_others = _run(sched, PROMPTS[:1] + PROMPTS[1:], **kw)[0]
    finally:
        sched.stop()
    assert with_others == alone


def test_queue_bound_and_limits(tiny_qwen3):
    from qconv.runtime.loader import load_model, load_tokenizer

    sched = Scheduler(load_model(tiny_qwen3), load_tokenizer(tiny_qwen3), max_batch=1, max_len=32, max_queue=2)
    mk = lambda n=4: GenRequest([5, 6, 7], n, lambda ev: None)  # noqa: E731
    sched.submit(mk())
    sched.submit(mk())
    with pytest.raises(QueueFull):
        sched.submit(mk())
    with pytest.raises(ValueError, match="> 32"):
        sched.submit(mk(40))


def test_history_drafts_from_earlier_requests_and_changes_nothing(tiny_qwen3):
    """A finished request's prompt + output drafts for later ones whose own text has no match (suffix decoding);
    greedy output stays what plain decoding gives."""
    plain = _scheduler(tiny_qwen3)
    try:
        first = _run(plain, PROMPTS[:1])[0][0]
        later = _run(plain, PROMPTS[1:2])[0]
    finally:
        plain.stop()
    spec = _scheduler(tiny_qwen3, spec_tokens=4)
    try:
        assert _run(spec, PROMPTS[:1])[0][0] == first
        tok = spec.tokenizer
        # a new request that continues what the first one wrote: its own text is too short to match itself
        cont = tok.decode(tok(PROMPTS[0]).input_ids[-3:] + first[:2])
        before = spec.metrics.history_drafts
        _run(spec, [cont])
        assert spec.metrics.history_drafts > before
        assert _run(spec, PROMPTS[1:2])[0] == later
    finally:
        spec.stop()


def test_datastore_drafts_when_nothing_else_matches_and_changes_nothing(tiny_qwen3):
    """A --datastore corpus holding what the model writes drafts for greedy rows; the output stays plain greedy."""
    from qconv.runtime.datastore import Datastore

    plain = _scheduler(tiny_qwen3)
    try:
        ref = _run(plain, PROMPTS[2:3])[0][0]
    finally:
        plain.stop()
    prompt_ids = plain.tokenizer(PROMPTS[2]).input_ids
    store = Datastore.build([prompt_ids[-4:] + ref])  # a corpus that once saw this continuation
    spec = _scheduler(tiny_qwen3, spec_tokens=4, datastore=store)
    try:
        assert _run(spec, PROMPTS[2:3])[0][0] == ref
        assert spec.metrics.datastore_drafts > 0 and spec.metrics.accepted_tokens > 0
        assert "qconv_spec_datastore_drafts_total" in spec.metrics.render()
    finally:
        spec.stop()
