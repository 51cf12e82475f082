"""The continuous-batching scheduler on the runtime model API, without HTTP: batched requests produce what they
produce alone, speculation (per-row drafts, verification, cache rollback incl. Gated-DeltaNet state) changes
nothing in greedy output, and the queue bound holds."""

from __future__ import annotations

import pytest

from qconv.engine.sampling import SamplingParams
from qconv.engine.spec import SpecConfig
from qconv.serve.scheduler import GenRequest, QueueFull, Scheduler
from tests.sched_helpers import submit_and_wait

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "def add(a, b):\n    return a + b\n\n",
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First",
    "0123456789",
]


def _run(sched: Scheduler, prompts: list[str], max_tokens: int = 24, **kw) -> list[tuple[list[int], str]]:
    """Submit all prompts at once; (token ids, finish reason) per prompt once every one has finished."""
    reqs = [GenRequest(sched.tokenizer(p).input_ids, max_tokens, None, **kw) for p in prompts]
    out = submit_and_wait(sched, reqs, timeout=300)
    return [(r.out_ids, out[i]) for i, r in enumerate(reqs)]


def _scheduler(path, **kw) -> Scheduler:
    from qconv.engine.loader import load_model, load_tokenizer

    return Scheduler(load_model(path), load_tokenizer(path), max_batch=4, max_len=256, **kw).start()


@pytest.mark.parametrize(
    "family,methods", [("llama", ["lookup"]), ("qwen3", ["lookup"]), ("qwen3_5", ["lookup", "mtp", "hybrid"])]
)
def test_batched_and_speculative_greedy_equal_alone(tiny_models, family, methods):
    """fp32: batched rows, and every drafter's per-row drafts verified in the batched forward, give plain greedy."""
    path = tiny_models(family)
    plain = _scheduler(path)
    try:
        alone = [_run(plain, [p])[0] for p in PROMPTS]
        together = _run(plain, PROMPTS)
    finally:
        plain.stop()
    assert together == alone
    for method in methods:
        spec = _scheduler(path, spec=SpecConfig(method, max_block=4, adaptive=False))
        try:
            drafted = _run(spec, PROMPTS)
        finally:
            spec.stop()
        assert drafted == alone, method
        v = {
            k: spec.metrics.value(f"qconv_{k}_total")
            for k in ("spec_draft_tokens", "spec_accepted_tokens", "step_tokens", "generation_tokens")
        }
        assert v["spec_draft_tokens"] > 0  # drafts were proposed and verified
        assert 0 <= v["spec_accepted_tokens"] <= v["spec_draft_tokens"]
        assert v["step_tokens"] == v["generation_tokens"] - len(PROMPTS)  # prefill makes each request's first token
        assert sorted(plain.free) == sorted(spec.free) == list(range(4))  # every slot came back


def test_seeded_sampling_independent_of_batch(tiny_qwen3):
    sched = _scheduler(tiny_qwen3, spec=SpecConfig("lookup", max_block=3))
    try:
        kw = dict(sampling=SamplingParams(temperature=0.9, top_p=0.95), seed=11)
        alone = _run(sched, PROMPTS[:1], **kw)[0]
        with_others = _run(sched, PROMPTS[:1] + PROMPTS[1:], **kw)[0]
    finally:
        sched.stop()
    assert with_others == alone


def test_queue_bound_and_limits(tiny_qwen3):
    from qconv.engine.loader import load_model, load_tokenizer

    sched = Scheduler(load_model(tiny_qwen3), load_tokenizer(tiny_qwen3), max_batch=1, max_len=32, max_queue=2)
    mk = lambda n=4: GenRequest([5, 6, 7], n, lambda ev: None)  # noqa: E731
    sched.submit(mk())
    sched.submit(mk())
    with pytest.raises(QueueFull):
        sched.submit(mk())
    with pytest.raises(ValueError, match="> 32"):
        sched.submit(mk(40))


def test_generate_and_serve_run_one_decode_loop(tiny_qwen3, monkeypatch):
    """`qconv generate` and `qconv serve` drive the same engine loop (runtime/batch.py): every forward of either goes
    through it, and a seeded, speculative, sampled request gives the same tokens on both."""
    import qconv.engine.batch as batch
    from qconv.engine.generate import GenerationConfig, generate_tokens
    from qconv.engine.loader import load_model, load_tokenizer

    model, tok = load_model(tiny_qwen3), load_tokenizer(tiny_qwen3)
    calls = {"model": 0, "loop": 0}

    class Counted:
        def __init__(self, m):
            self.m, self.config, self.device = m, m.config, m.device

        def new_cache(self, *a, **kw):
            return self.m.new_cache(*a, **kw)

        def __call__(self, *a, **kw):
            calls["model"] += 1
            return self.m(*a, **kw)

    real = batch._forward

    def loop_forward(*a, **kw):
        calls["loop"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(batch, "_forward", loop_forward)
    sp, spec = SamplingParams(temperature=0.9, top_p=0.95), SpecConfig("lookup", max_block=3)
    ids = tok(PROMPTS[0]).input_ids
    alone = list(generate_tokens(Counted(model), ids, GenerationConfig(24, sp, seed=11, spec=spec)))
    sched = Scheduler(Counted(model), tok, max_batch=2, max_len=256, spec=spec).start()
    try:
        req = GenRequest(ids, 24, None, sp, seed=11)
        submit_and_wait(sched, [req], timeout=300)
    finally:
        sched.stop()
    assert calls["model"] == calls["loop"] > 2
    assert req.out_ids == alone


def _manual(path, **kw) -> Scheduler:
    """A scheduler whose steps the test runs itself (no thread), to count them."""
    from qconv.engine.loader import load_model, load_tokenizer

    return Scheduler(load_model(path), load_tokenizer(path), max_batch=4, max_len=512, **kw)


def test_a_long_prefill_delays_a_short_request_by_one_chunk(tiny_qwen3):
    """A 400-token prompt is fed 32 tokens per step, each step also decoding the running requests: a 2-token
    request that arrives after its first chunk has its first token one step later, while the long prompt is still
    being fed; no forward feeds more than a chunk."""
    sched = _manual(tiny_qwen3, prefill_chunk=32)
    fed = []
    forward = sched.model.forward

    def counting(tokens, *a, **k):
        fed.append(tokens.numel())
        return forward(tokens, *a, **k)

    sched.model.forward = counting
    running = GenRequest(sched.tokenizer("The quick brown").input_ids, 60, lambda ev: None)
    sched.submit(running)
    sched.step()
    assert running.out_ids  # decoding
    long = GenRequest(list(range(5, 405)), 4, lambda ev: None)
    sched.submit(long)
    sched.step()
    assert not long.out_ids and len(sched.prefilling.rows) == 1
    before = len(running.out_ids)
    short = GenRequest([11, 12], 4, lambda ev: None)
    sched.submit(short)
    sched.step()
    assert short.out_ids, "the short request waited for more than one chunk"
    assert not long.out_ids  # the long prompt is still being fed, a chunk at a time
    assert len(running.out_ids) == before + 1  # and the running request advanced one token per step
    steps = 3
    while not long.out_ids:
        sched.step()
        steps += 1
    assert steps - 1 >= 400 // 32  # chunked: one chunk per step
    prefill_forwards = [n for n in fed if n > 4]  # decode forwards feed one token per row
    assert max(prefill_forwards) <= 32, prefill_forwards


@pytest.mark.parametrize("family,method", [("qwen3", "none"), ("qwen3_5", "mtp")])
def test_greedy_is_the_same_with_chunked_prefill(tiny_models, family, method):
    """fp32 greedy: prompts fed 16 tokens a step, beside each other, give what they give fed whole (the MTP drafter
    sees the hidden states of every chunk; Gated-DeltaNet state carries across chunks)."""
    path = tiny_models(family)
    prompts = [p * 3 for p in PROMPTS]
    whole = _scheduler(path, prefill_chunk=4096)
    try:
        alone = [_run(whole, [p])[0] for p in prompts]
    finally:
        whole.stop()
    spec = SpecConfig(method, max_block=4, adaptive=False) if method != "none" else SpecConfig("none")
    chunked = _scheduler(path, prefill_chunk=16, spec=spec)
    try:
        together = _run(chunked, prompts)
    finally:
        chunked.stop()
    assert together == alone


def _penalized_reference(model, prompt: list[int], n: int, fp: float, pp: float) -> list[int]:
    """Greedy decoding by hand, the whole sequence each step: logits - count * fp - (count > 0) * pp."""
    import torch

    out: list[int] = []
    for _ in range(n):
        cache = model.new_cache(1, len(prompt) + n + 1)
        logits = model(torch.tensor([prompt + out]), cache)[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        out.append(int((logits - counts * fp - (counts > 0) * pp).argmax()))
    return out


@pytest.mark.parametrize("fp,pp", [(1.5, 0.0), (0.0, 2.0), (-2.0, 0.0)])
def test_repetition_penalties_are_applied_as_openai_defines_them(tiny_qwen3, fp, pp):
    """Greedy with frequency/presence penalties equals decoding by hand with them, also with a drafter beside it,
    and differs from greedy without them."""
    sched = _scheduler(tiny_qwen3)
    spec = _scheduler(tiny_qwen3, spec=SpecConfig("lookup", max_block=4, adaptive=False))
    prompt = PROMPTS[0]
    try:
        ids = sched.tokenizer(prompt).input_ids
        want = _penalized_reference(sched.model, ids, 20, fp, pp)
        params = SamplingParams(0.0, frequency_penalty=fp, presence_penalty=pp)
        got = _run(sched, [prompt], 20, sampling=params)[0][0]
        drafted = _run(spec, [prompt], 20, sampling=params)[0][0]
        plain = _run(sched, [prompt], 20)[0][0]
    finally:
        sched.stop()
        spec.stop()
    assert got == want and drafted == want
    assert plain != want  # the penalty changed what greedy picks


def test_each_verified_position_is_penalized_by_the_drafts_before_it():
    """In a block, row i is scored after generated + draft[:i]: what plain decoding would have seen there."""
    import torch

    from qconv.engine.sampling import penalize

    logits = torch.zeros(3, 6)
    params = SamplingParams(0.0, frequency_penalty=1.0, presence_penalty=0.5)
    out = penalize(logits, [2, 2], [4, 2], params)
    want = torch.zeros(3, 6)
    want[:, 2] -= 2 * 1.0 + 0.5  # generated twice
    want[1:, 4] -= 1.0 + 0.5  # the first draft, from row 1 on
    want[2, 2] -= 1.0  # the second draft: a third 2
    assert torch.equal(out, want)
