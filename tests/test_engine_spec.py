"""Speculative decoding, sampling and generation: lossless greedy, distribution-preserving rejection sampling
(through `generate` and through the server's scheduler), prompt lookup, the draft length, incremental
detokenization; first on a toy model implementing the runtime API, then on real models."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from qconv.engine.detok import TextStream
from qconv.engine.generate import GenerationConfig, GenerationStats, generate_tokens, stream_text
from qconv.engine.sampling import SamplingParams, probs_from_logits, verify_greedy, verify_sampling
from qconv.engine.spec import Draft, DraftLength, PromptLookup, SpecConfig, Speculator


# --- a toy model with the runtime API: next-token logits depend on the last two tokens; rollback cuts lengths ---
class ToyCache:
    def __init__(self, max_batch, max_len):
        self.lengths = torch.zeros(max_batch, dtype=torch.long)
        self.tokens = torch.zeros(max_batch, max_len, dtype=torch.long)
        self.mtp = None

    def rollback(self, slots, n_keep):
        for s, n in zip(slots, n_keep):
            assert 0 <= n <= int(self.lengths[s])
            self.lengths[s] = n

    def reset(self, slots):
        self.lengths[slots] = 0
        if self.mtp is not None:
            self.mtp.reset(slots)


class ToyMTP:
    """Predicts from the embedding of the next token and the hidden state; keeps a cache like the real one."""

    def __init__(self, vocab, hidden, g):
        self.table = torch.randn(vocab, vocab, generator=g) * 2
        self.mix = torch.randn(hidden, vocab, generator=g)
        self.emb = torch.randn(vocab, hidden, generator=g)

    def __call__(self, hidden, next_tokens, cache, slots=None):
        B, T = next_tokens.shape
        for s in slots if slots is not None else range(B):
            cache.mtp.lengths[s] += T
        return self.table[next_tokens] + hidden @ self.mix, self.emb[next_tokens] + 0.1 * hidden


class ToyModel:
    def __init__(self, vocab=12, hidden=8, eos=1, seed=0, mtp=True):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab * vocab, vocab, generator=g) * 2.5
        self.hid = torch.randn(vocab * vocab, hidden, generator=g)
        self.config = SimpleNamespace(eos_token_ids=[eos], max_position_embeddings=4096, vocab_size=vocab)
        self.mtp = ToyMTP(vocab, hidden, g) if mtp else None
        self.forwards = []
        self.device = torch.device("cpu")  # the runtime API: drivers put token tensors on the model's device

    def new_cache(self, max_batch, max_len, kv_scheme="bf16"):
        cache = ToyCache(max_batch, max_len)
        if self.mtp is not None:
            cache.mtp = ToyCache(max_batch, max_len)
        return cache

    def __call__(self, tokens, cache, slots=None, return_hidden=False):
        B, T = tokens.shape
        slots = torch.arange(B) if slots is None else torch.as_tensor(slots)
        self.forwards.append(T)
        logits, hidden = [], []
        for b, s in enumerate(slots.tolist()):
            n = int(cache.lengths[s])
            cache.tokens[s, n : n + T] = tokens[b]
            cache.lengths[s] = n + T
            hist = cache.tokens[s, : n + T]
            prev = torch.cat([hist.new_zeros(1), hist[:-1]])[n:]
            key = prev * self.vocab + hist[n:]
            logits.append(self.table[key])
            hidden.append(self.hid[key])
        logits = torch.stack(logits)
        return (logits, torch.stack(hidden)) if return_hidden else logits


def plain(model, prompt, cfg):
    return list(generate_tokens(model, prompt, GenerationConfig(cfg.max_tokens, cfg.sampling, cfg.seed)))


# --- sampling ---
def test_probs_filters_and_greedy():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    p = probs_from_logits(logits, temperature=1.0, top_k=2)
    assert (p[0, :2] == 0).all() and (p[1, 2:] == 0).all() and torch.allclose(p.sum(-1), torch.ones(2))
    full = torch.softmax(logits[0], -1)  # [.032, .087, .237, .644]: top_p .7 keeps {3, 2}, top_p .6 keeps {3}
    assert (probs_from_logits(logits[:1], 1.0, top_p=0.7)[0] > 0).tolist() == [False, False, True, True]
    assert (probs_from_logits(logits[:1], 1.0, top_p=0.6)[0] > 0).tolist() == [False, False, False, True]
    assert torch.allclose(probs_from_logits(logits[:1], 1.0)[0], full)
    mixed = probs_from_logits(logits, temperature=torch.tensor([0.0, 1.0]))  # per-row settings in one batch
    assert mixed[0].tolist() == [0, 0, 0, 1] and torch.allclose(mixed[1], torch.softmax(logits[1], -1))


def test_verify_greedy():
    logits = torch.eye(5)[[2, 3, 4, 0]]  # target argmax: 2, 3, 4, 0
    assert verify_greedy([2, 3, 1], logits) == (2, 4)
    assert verify_greedy([2, 3, 4], logits) == (3, 0)  # all accepted: bonus token
    assert verify_greedy([], logits[:1]) == (0, 2)


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_preserves_target_distribution(point_mass):
    """The token emitted at the first draft position must follow p exactly, whatever q is."""
    g = torch.Generator().manual_seed(1234)
    V, N = 6, 20000
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    counts = torch.zeros(V)
    for _ in range(N):
        x = 2 if point_mass else int(torch.multinomial(q, 1, generator=g))
        n, tok = verify_sampling([x], [None if point_mass else q], p, g)
        counts[x if n == 1 else tok] += 1
    expected = (p[0] * N).numpy()
    assert chisquare(counts.numpy(), expected).pvalue > 1e-3
    # the test has power: a verifier that always accepted would follow q (or the point mass) instead
    wrong = q if not point_mass else torch.eye(V)[2] * 0.9 + 0.1 / V
    assert chisquare(counts.numpy(), (wrong * N).numpy()).pvalue < 1e-6


def test_rejection_sampling_bonus_and_identical_distributions():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, generator=g), -1)
    counts = torch.zeros(5)
    for _ in range(6000):  # q == p: every draft is accepted, and the bonus follows p[2]
        n, tok = verify_sampling([1, 3], [p[0], p[1]], p, g)
        assert n == 2
        counts[tok] += 1
    assert chisquare(counts.numpy(), (p[2] * 6000).numpy()).pvalue > 1e-3


# --- prompt lookup and draft length ---
def test_lookup_longest_first_and_periodic():
    lk = PromptLookup(1, 3)
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]
    # suffix [6, 7] occurs twice earlier; no copy position yet: the first -> continuation 8, 9, 1
    assert lk.propose(seq, 3).tokens == [8, 9, 1]
    seq2 = seq + [8]  # suffix [6, 7, 8] (n=3) matches only at the start even though [7, 8] ... -> 9, 1
    assert lk.propose(seq2, 2).tokens == [9, 1]
    assert PromptLookup().propose([1, 2, 3], 4).tokens == []  # no earlier occurrence of any suffix
    # a copy in progress: source [9, 5, 1, 7, 5, 2, 8], output so far [9, 5, 1] -> continues at 7 (cursor)
    src = [0, 9, 5, 1, 7, 5, 2, 8, 3]
    lk3 = PromptLookup(1, 2)
    assert lk3.propose(src + [9, 5], 2).tokens == [1, 7]
    # the output substituted 4 for 7 and goes on: "5" alone matches 3 places; the copy position wins
    assert lk3.propose(src + [9, 5, 1, 4, 5], 2).tokens == [2, 8]
    assert PromptLookup(1, 2).propose(src + [9, 5, 1, 4, 5], 2).tokens == [1, 7]  # no cursor: the first
    assert PromptLookup(1, 2).propose([4, 1, 2, 1, 2], 5).tokens == [1, 2, 1, 2, 1]  # a loop repeats past the end
    assert PromptLookup(2, 4).propose([4, 1, 2, 3, 1], 3).tokens == []  # single-token matches are below ngram_min


def test_lookup_drafts_the_whole_block_on_a_long_verbatim_run():
    src = list(range(10, 40))
    seq = [1, 2] + src + [3] + src[:12]  # copying src, 12 tokens in
    lk = PromptLookup(2, 4, sure=8)
    assert lk.propose(seq, 2, most=10).tokens == src[12:22]  # run >= 8: the block
    assert lk.propose(seq, 2).tokens == src[12:14]  # no room given: k
    short = [1, 2] + src + [3, 6] + src[10:12] + [5, 7] + src[10:12]  # a 2-token match, two continuations
    assert PromptLookup(2, 4, sure=8).propose(short, 2, most=10).tokens == src[12:14]
    once = [1, 2] + src + [3, 7] + src[10:12]  # the same match, one continuation: sure
    assert PromptLookup(2, 4, sure=8).propose(once, 2, most=10).tokens == src[12:22]
    ambiguous = [5, 6, 8, 5, 7, 8, 4, 5]  # a single token seen twice with different continuations: not sure
    assert PromptLookup(1, 4).propose(ambiguous, 2, most=10).tokens == [6, 8]
    agreeing = [6, 8, 1, 6, 8, 2, 6]  # every earlier "6" went on as 8: sure, the block (periodic past the end)
    assert PromptLookup(1, 4).propose(agreeing, 2, most=10).tokens == [8, 1, 6, 8, 2, 6, 8, 1, 6, 8]
    sp = Speculator(PromptLookup(2, 4, sure=8), DraftLength(most=10, rate=0.0))
    sp.begin(seq, None, 0, None, seq[-1])
    assert sp.draft(seq, 6).tokens == src[12:18]  # the EMA says 0, a sure run still drafts (up to the room)


def test_draft_length_follows_acceptance():
    dl = DraftLength(most=15)
    for _ in range(20):
        dl.update(4, 0)
    assert dl() == 0  # drafts that never hit are not worth a wider forward
    for _ in range(30):
        dl.update(1, 1)  # what the probes of the next steps score
    assert dl() == 15
    for _ in range(3):
        dl.update(15, 0)
    assert dl() == 15  # all or nothing: a few misses do not cut the block short
    for _ in range(6):
        dl.update(15, 0)
    assert dl() == 0
    assert DraftLength(most=6, adaptive=False)() == 6


class FixedHead:
    """A model drafter that always proposes the same k tokens."""

    needs_hidden = True

    def __init__(self, tokens):
        self.tokens = tokens

    def begin(self, prompt, cache, slot=0):
        pass

    def observe(self, hidden, next_tokens):
        pass

    def propose(self, seq, k, most=None):
        return Draft(self.tokens[:k], [None] * min(k, len(self.tokens)))


def test_hybrid_stretches_only_after_the_drafter_saturates():
    from qconv.engine.spec import HybridDrafter

    hd = HybridDrafter(FixedHead([7, 8]), PromptLookup(1, 2), after_saturated=2)
    seq = [1, 7, 8, 5, 6, 1]  # after "1, 7, 8" lookup continues "5, 6, 1, ..."
    hd.begin(seq, None)
    assert hd.propose(seq, 6).tokens == [7, 8]  # not saturated yet: the drafter's own tokens
    hd.observe(None, [7, 8, 5])  # accepted whole
    assert hd.propose(seq, 6).tokens == [7, 8]
    hd.observe(None, [7, 8, 5])
    assert hd.propose(seq, 6).tokens == [7, 8, 5, 6, 1, 7]  # two full acceptances: lookup stretches the block
    hd.observe(None, [7, 3])  # the drafter's second token was rejected: back to its own block
    assert hd.propose(seq, 6).tokens == [7, 8]
    assert HybridDrafter(FixedHead([7, 8]), PromptLookup(1, 2)).propose(seq, 6).tokens == [7, 8, 5, 6, 1, 7]


def test_speculator_probes_when_it_drafts_nothing():
    sp = Speculator(PromptLookup(1, 2), DraftLength(most=8, rate=0.0))
    seq = [3, 4, 5, 3, 6, 2, 3]  # "3" went on as 4 and as 6: an unsure match
    sp.begin(seq[:-1], None, 0, None, 3)
    assert sp.draft(seq, 8).tokens == []  # not worth verifying, but its first token is scored
    sp.verified(Draft(), [4], None)
    assert sp.length.rate > 0


def test_spec_config_from_the_artifact_block():
    from qconv.recipes.sections import Lookup, Speculative

    block = Speculative("hybrid", 4, Lookup(max_block=15, ngram_max=4, ngram_min=2))
    sc = SpecConfig.from_manifest(block)
    assert (sc.method, sc.k, sc.max_block, sc.ngram_min, sc.ngram_max) == ("hybrid", 4, 15, 2, 4)
    stretched = Speculative("hybrid", 4, Lookup(max_block=15, after_saturated=2))
    assert SpecConfig.from_manifest(stretched).after_saturated == 2
    assert SpecConfig.from_manifest(block, tokens=0).method == "none"
    lk = SpecConfig.from_manifest(Speculative("lookup", 4, Lookup(max_block=8)), 6)
    assert (lk.method, lk.max_block) == ("lookup", 6)
    assert SpecConfig.from_manifest(None).method == "none"
    assert SpecConfig.from_manifest(block).for_model(SimpleNamespace(mtp=None)).method == "lookup"
    assert SpecConfig.from_manifest(Speculative("dflash", 4, drafter="d")).method == "lookup"


# --- incremental detokenization ---
class CharTok:
    """Token i decodes to one letter; tokens >= 100 are halves of a two-token character (the first alone is an
    incomplete UTF-8 sequence). Counts the ids decoded, to check the work per token stays bounded."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        out, i = "", 0
        while i < len(ids):
            if ids[i] >= 100:
                out += "\u00e9" if i + 1 < len(ids) else "\ufffd"
                i += 2
            else:
                out += chr(ord("a") + ids[i])
                i += 1
        return out


def test_text_stream_is_incremental_and_stops():
    tok = CharTok()
    ts = TextStream(tok)
    pieces = [ts.push([t]) for t in [0, 1, 100, 101, 2] * 200]
    assert "".join(pieces) + ts.finish() == ("ab\u00e9c" * 200)
    assert pieces[2] == "" and pieces[3] == "\u00e9"  # half a character is held back
    assert tok.decoded < 10 * 1000  # O(1) tokens decoded per step, not the whole output
    ts = TextStream(CharTok(), stop=("cd",))
    out = "".join(ts.push([t]) for t in [0, 1, 2, 3, 4])
    assert out == "ab" and ts.stopped and ts.finish() == ""


def test_stream_text_stops_on_stop_string():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    stats = GenerationStats()
    toks = generate_tokens(ToyModel(eos=99), [2, 3, 4], GenerationConfig(max_tokens=30), stats)
    full = "".join(chr(ord("a") + t) for t in plain(ToyModel(eos=99), [2, 3, 4], GenerationConfig(max_tokens=30)))
    stop = full[5:7]
    text = "".join(stream_text(Tok(), toks, (stop,)))
    assert text == full[: full.find(stop)]
    assert stats.new_tokens < 30  # generation stopped early


# --- generation on the toy model ---
TOY_PROMPTS = [[(3 * i + j * j) % 10 + 2 for j in range(6 + i % 5)] * (1 + i % 3) for i in range(20)]


@pytest.mark.parametrize("method", ["lookup", "mtp", "hybrid"])
def test_toy_greedy_speculative_equals_plain(method):
    model = ToyModel()
    for adaptive, after in ((True, 0), (False, 0), (False, 2)):
        cfg = GenerationConfig(max_tokens=40, spec=SpecConfig(method, adaptive=adaptive, after_saturated=after))
        for prompt in TOY_PROMPTS:
            stats = GenerationStats()
            out = list(generate_tokens(model, prompt, cfg, stats))
            assert out == plain(model, prompt, cfg)
            assert stats.new_tokens == len(out)


def test_toy_speculation_saves_forwards_on_repetitive_output():
    model = ToyModel(eos=99)  # no eos: the toy chain falls into a loop lookup can copy
    cfg = GenerationConfig(max_tokens=120, spec=SpecConfig("lookup"))
    stats = GenerationStats()
    out = list(generate_tokens(model, TOY_PROMPTS[0], cfg, stats))
    assert out == plain(model, TOY_PROMPTS[0], cfg)
    assert stats.tokens_per_step > 2.0, stats.to_dict()
    d = stats.to_dict()
    assert len(d["acceptance_per_position"]) == 15 and d["acceptance_per_position"][-1] > 0  # full blocks taken


SAMPLED_PROMPT = [0, 1, 2, 3, 4, 1, 0, 4, 3, 2]  # every token has an earlier occurrence: lookup always matches
# the second step verifies a block of one MTP draft (a sampled q) and one prompt-lookup draft (a point mass)
SAMPLED_SPEC = SpecConfig("hybrid", k=1, max_block=2, ngram_min=1, adaptive=False)


def _third_token_marginal(model) -> torch.Tensor:
    p = lambda a, b: torch.softmax(model.table[a * 5 + b], -1)  # noqa: E731
    p1 = p(3, 2)
    return sum(p1[a] * p(2, a)[b] * p(a, b) for a in range(5) for b in range(5))


def test_toy_sampling_distribution_preserved():
    """End to end through `generate`: the third generated token follows the exact marginal of the model."""
    model = ToyModel(vocab=5, eos=99, seed=3)
    sp = SamplingParams(temperature=1.0)
    counts, N, stats = torch.zeros(5), 1000, GenerationStats()
    for seed in range(N):
        cfg = GenerationConfig(max_tokens=4, sampling=sp, spec=SAMPLED_SPEC, seed=seed)
        counts[list(generate_tokens(model, SAMPLED_PROMPT, cfg, stats))[2]] += 1
    assert stats.drafted[1] > N // 2  # two-token blocks were verified
    assert chisquare(counts.numpy(), (_third_token_marginal(model) * N).numpy()).pvalue > 1e-3


def test_server_path_sampling_distribution_preserved():
    """The same through the batched scheduler the server runs (per-row drafts, one batched verify forward)."""
    from qconv.serve.scheduler import GenRequest, Scheduler

    model = ToyModel(vocab=5, eos=99, seed=3)
    tok = SimpleNamespace(eos_token_id=None, decode=lambda ids, skip_special_tokens=True: "x" * len(ids))
    sched = Scheduler(model, tok, max_batch=8, max_len=32, max_queue=2000, spec=SAMPLED_SPEC).start()
    N, done, lock = 1000, threading.Event(), threading.Lock()
    finished = [0]

    def emit(ev):
        if ev.finish_reason:
            with lock:
                finished[0] += 1
                if finished[0] == N:
                    done.set()

    reqs = [GenRequest(list(SAMPLED_PROMPT), 4, emit, SamplingParams(temperature=1.0), seed=s) for s in range(N)]
    try:
        for r in reqs:
            sched.submit(r)
        assert done.wait(300)
    finally:
        sched.stop()
    counts = torch.bincount(torch.tensor([r.out_ids[2] for r in reqs]), minlength=5).float()
    assert sched.metrics.value("qconv_spec_draft_tokens_total") > N  # drafts were verified
    assert chisquare(counts.numpy(), (_third_token_marginal(model) * N).numpy()).pvalue > 1e-3


# --- real models ---
class OracleDrafter:
    """Proposes the known greedy continuation with a wrong token at a varying position, so verification accepts
    every possible prefix length and the cache (KV and Gated-DeltaNet state) is rolled back to each of them."""

    needs_hidden = False

    def __init__(self, reference: list[int], prompt_len: int):
        self.ref, self.start, self.calls = reference, prompt_len, 0

    def begin(self, prompt, cache, slot):
        pass

    def observe(self, hidden, next_tokens):
        pass

    def propose(self, seq, k, most=None):
        done = len(seq) - self.start
        toks = list(self.ref[done : done + min(k, 6)])
        self.calls += 1
        bad = self.calls % 7
        if bad < len(toks):
            toks[bad] = (toks[bad] + 1) % 97
        return Draft(toks, [None] * len(toks))


def _greedy_matches(model, prompts, spec: SpecConfig, max_tokens):
    totals = GenerationStats()
    for ids in prompts:
        ref = list(generate_tokens(model, ids, GenerationConfig(max_tokens=max_tokens)))
        out = list(generate_tokens(model, ids, GenerationConfig(max_tokens=max_tokens, spec=spec), totals))
        assert out == ref, f"{spec.method} diverged from plain greedy on prompt {ids[:8]}..."
    return totals


def _prompts(tok, n):
    return [tok(f"def add{i}(a, b):\n    return a + b {i} the quick brown fox")["input_ids"] for i in range(n)]


@pytest.mark.parametrize(
    "family,method",
    [("llama", "lookup"), ("qwen3", "lookup"), ("qwen3_5", "lookup"), ("qwen3_5", "mtp"), ("qwen3_5", "hybrid")],
)
def test_tiny_greedy_speculative_equals_plain(tiny_models, family, method, one_thread):
    """fp32, the tiny llama / qwen3 / qwen3_5 models: every drafter's greedy output is plain greedy's."""
    from qconv.engine.loader import load_model, load_tokenizer

    path = tiny_models(family)
    model, tok = load_model(path), load_tokenizer(path)
    stats = _greedy_matches(model, _prompts(tok, 6), SpecConfig(method, adaptive=False), max_tokens=12)
    assert stats.drafted[0] > 0  # drafts were really verified (random weights: mostly rejected)


def test_qwen35_rollback_at_every_accept_length(tiny_qwen3_5, one_thread, monkeypatch):
    import qconv.engine.generate as gen_mod
    from qconv.engine.loader import load_model, load_tokenizer

    model, tok = load_model(tiny_qwen3_5), load_tokenizer(tiny_qwen3_5)
    for ids in _prompts(tok, 4):
        ref = list(generate_tokens(model, ids, GenerationConfig(max_tokens=24)))
        oracle = Speculator(OracleDrafter(ref, len(ids)), DraftLength(6, adaptive=False))
        monkeypatch.setattr(gen_mod, "make_speculator", lambda *a, oracle=oracle, **k: oracle)
        stats = GenerationStats()
        out = list(generate_tokens(model, ids, GenerationConfig(max_tokens=24, spec=SpecConfig("lookup")), stats))
        assert out == ref
        assert stats.tokens_per_step > 1.5 and stats.accepted[3] > 0  # long accepted runs were rolled back into


@pytest.mark.slow
def test_smollm2_lookup_greedy_equals_plain(smollm2, shared_data, one_thread):
    from qconv.engine.generate import encode_prompt
    from qconv.engine.loader import load_model, load_tokenizer

    model, tok = load_model(smollm2), load_tokenizer(smollm2)
    lines = [s.strip() for s in (shared_data / "tinyshakespeare.txt").read_text().split("\n\n")[1:80]]
    texts = [s.replace("\n", " ")[:160] for s in lines if len(s) > 60][:12]
    prompts = [encode_prompt(tok, "Repeat exactly: " + t, chat=True) for t in texts]
    stats = _greedy_matches(model, prompts, SpecConfig("lookup"), max_tokens=12)
    assert stats.tokens_per_step > 1.2, stats.to_dict()  # copying pays even in 12 tokens


# --- CLI ---
def test_cli_generate(tiny_llama, tmp_path, one_thread):
    from click.testing import CliRunner

    from qconv.cli import main

    r = CliRunner().invoke(
        main,
        [
            "generate",
            str(tiny_llama),
            "--chat",
            "the quick brown fox",
            "--max-tokens",
            "6",
            "--spec",
            "lookup",
            "--stats",
        ],
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["generate", str(tiny_llama), "--prompt", "x", "--max-block", "16"])
    assert r.exit_code == 2 and "--max-block 16 out of range" in r.output
    r = CliRunner().invoke(main, ["generate", str(tmp_path), "--prompt", "x"])
    assert r.exit_code == 2 and "no config.json" in r.output


def test_spec_bench_workload_speedup_report(tiny_llama, tmp_path, one_thread, monkeypatch):
    """bench/spec_workloads.py: speculative and plain decode on a workload file, greedy outputs identical; a file
    without the workload's field is one clear error."""
    from pathlib import Path

    from qconv.errors import QconvError

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_workloads import run_bench

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(f'{{"turns": ["print add {i} and the quick brown fox"]}}\n' for i in range(3)))
    cfg = GenerationConfig(max_tokens=8, spec=SpecConfig("lookup", max_block=6))
    rep, ids, outputs = run_bench(tiny_llama, "chat", data, prompts=2, cfg=cfg)
    assert rep["prompts"] == len(ids) == len(outputs) == 2 and rep["spec"] == "lookup" and rep["max_block"] == 6
    assert rep["ours"]["identical_to_plain"] is True and rep["ours"]["new_tokens"] == sum(map(len, outputs)) > 0
    assert rep["ours"]["speedup"] > 0 and len(rep["ours"]["acceptance_per_position"]) >= 1
    with pytest.raises(QconvError, match="'prompt' field"):  # a chat file given to the code workload
        run_bench(tiny_llama, "code", data, cfg=cfg)


def test_code_copy_workloads_ask_for_the_whole_function_or_its_tests(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from qconv.errors import QconvError

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_workloads import workload_texts

    rows = [
        {
            "prompt": f'def f{i}(x):\n    """Doc {i}."""\n',
            "canonical_solution": f"    return x + {i}\n",
            "test": f"def check(candidate):\n    assert candidate({i}) == {2 * i}\n",
        }
        for i in range(3)
    ]
    f = tmp_path / "he.jsonl"
    f.write_text("\n".join(map(json.dumps, rows)) + "\n")
    texts = workload_texts("codecopy", f, 2)
    assert len(texts) == 2 and texts[1].startswith("Repeat the following Python code exactly.")
    assert texts[1].endswith('```python\ndef f1(x):\n    """Doc 1."""\n    return x + 1\n```')
    tests = workload_texts("testcopy", f, 3)
    assert (
        tests[2]
        == "Repeat the following Python code exactly.\n\n```python\ndef check(candidate):\n    assert candidate(2) == 4\n```"
    )
    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text(json.dumps({"prompt": "def g():\n"}) + "\n")
    with pytest.raises(QconvError, match="'canonical_solution' field"):
        workload_texts("codecopy", prompts_only, 1)
    with pytest.raises(QconvError, match="'test' field"):
        workload_texts("testcopy", prompts_only, 1)


def test_copy_workload_reads_wrapped_text(tmp_path, monkeypatch):
    import textwrap
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_workloads import workload_texts

    paras = [" ".join(f"Sentence {i}.{j} of paragraph {i} says something plain." for j in range(12)) for i in range(3)]
    wrapped = tmp_path / "wrapped.txt"
    wrapped.write_text("A Title\n=======\n\n" + "\n\n".join(textwrap.fill(p, 72) for p in paras) + "\n")
    one_per_line = tmp_path / "wiki.txt"
    one_per_line.write_text(" \n = A Title = \n \n" + "\n".join(f" {p} " for p in paras) + "\n")
    a, b = workload_texts("copy", wrapped, 5), workload_texts("copy", one_per_line, 5)
    assert len(a) == 3 and a == b
    assert all(f"of paragraph {i} says" in t for i, t in enumerate(a))


def test_cli_generate_honours_the_artifact_speculative_block(tiny_qwen3_5, tmp_path, one_thread):
    """`qconv generate` on a folder with qconv.json drafts as its `speculative` block says (here: MTP)."""
    import json
    import shutil

    from click.testing import CliRunner

    from qconv.cli import main
    from qconv.manifest import Manifest, RecipeInfo, SourceInfo

    art = tmp_path / "art"
    shutil.copytree(tiny_qwen3_5, art)
    Manifest(
        source=SourceInfo(kind="hf_dir", id=str(tiny_qwen3_5)),
        recipe=RecipeInfo("cpu", "ab" * 32, {}),
        modules=[],
        speculative={"method": "mtp", "num_speculative_tokens": 2},
    ).write(art)
    r = CliRunner().invoke(
        main, ["generate", str(art), "--prompt", "the quick brown fox", "--max-tokens", "6", "--stats"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stderr.strip().splitlines()[-1])["spec"] == "mtp"


def test_transformers_drafter_replay_reproduces_its_real_run(tiny_llama, one_thread, monkeypatch):
    """bench/spec_bench.py: the replay of transformers' prompt-lookup drafter on our greedy outputs counts the
    forwards its real `generate(prompt_lookup_num_tokens=...)` run takes when both engines produce the same text."""
    from pathlib import Path

    from qconv.engine.loader import load_model

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_bench import transformers_lookup_replay, transformers_run

    model = load_model(tiny_llama, dtype=torch.float32)
    eos = list(model.config.eos_token_ids)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(4)]  # the random model loops
    outputs = [list(generate_tokens(model, p, GenerationConfig(max_tokens=24))) for p in prompts]
    real = transformers_run(tiny_llama, prompts, 24, 15, eos, torch.float32)
    replay = transformers_lookup_replay(prompts, outputs, 24, 15, eos)
    assert real["new_tokens"] == replay["new_tokens"] == sum(map(len, outputs))
    assert replay["tokens_per_forward"] == real["tokens_per_forward"] > 1.5, (real, replay)


def test_spec_replay_on_saved_copy_output(tmp_path):
    """bench/spec_replay.py on a copied passage: the stretch beats plain k-token lookup, fixed blocks reach long
    runs, and the numbers are real ratios of steps."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    src = [(7 * i * i + 3 * i) % 97 + 3 for i in range(90)]
    prompt = [1] + src + [2, 9]
    rows = {"copy": [[prompt, src[:80]]]}
    f = tmp_path / "outs.json"
    f.write_text(json.dumps(rows))
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, str(repo / "bench" / "spec_replay.py"), str(f), "--max-tokens", "80"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    w = json.loads(r.stdout.strip().splitlines()[-1])["workloads"]["copy"]
    assert w["ngram_k"] <= 5 and w["stretched"] > 1.5 * w["ngram_k"] and w["lookup_fixed"] > 8


def test_lookup_default_takes_no_fewer_tokens_per_step_than_transformers_on_a_paraphrased_copy(monkeypatch):
    """Issue 32's regression guard, as a ratio of verify steps in one run: the default lookup (SpecConfig's
    acceptance gate, 1..4-grams as bench/spec_bench.py runs it) against transformers' prompt lookup (first 2-gram
    match, the whole block every step) replayed on the same outputs: copies of a word-like passage with an edit every
    7-13 tokens, as SmolLM2 rewrites what it repeats. Sizing the block by the acceptance EMA took 0.7x here."""
    from pathlib import Path

    from qconv.engine.spec import make_speculator

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_bench import transformers_lookup_replay
    from spec_replay import replay

    rows = []
    for seed in range(4):
        x, src = seed + 1, []
        for _ in range(160):  # 41 "words" (1-grams recur with different continuations), not periodic
            x = (x * 1103515245 + 12345) % 2**31
            src.append((x >> 16) % 41 + 3)
        out, i, edit = [], 0, 7 + seed
        while len(out) < 128:
            out += src[i : i + edit] + [50 + len(out) % 7]  # a rewritten word, then the copy goes on
            i, edit = i + edit + 1, 7 + (edit * 5 + seed) % 7
        rows.append([[1, *src, 2], out[:128]])
    ours = replay(lambda: make_speculator(SpecConfig("lookup", ngram_min=1), None), rows, 128)
    theirs = transformers_lookup_replay([p for p, _ in rows], [o for _, o in rows], 128, 15, [999])
    assert ours >= theirs["tokens_per_forward"] > 2, (ours, theirs)


def test_lookup_follows_the_copy_where_lines_share_their_openings(monkeypatch):
    """Issue 32: a verbatim copy of lines that open alike (a unit test's `assert candidate(`) is where transformers'
    first-match lookup loses its place: each shared opening sends it back to the first line's continuation, while
    ours follows the copy it is in. bench/spec_bench.py's `testcopy` workload is this on SmolLM2."""
    from pathlib import Path

    from qconv.engine.spec import make_speculator

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_bench import transformers_lookup_replay
    from spec_replay import replay

    rows = []
    for seed in range(3):
        lines = [[10, 11, 12, 20 + (i + seed) % 17, 40 + (i * 7 + seed) % 13, 60 + (i * 5) % 11, 13] for i in range(20)]
        src = [t for line in lines for t in line]
        rows.append([[1, *src, 2], src[:128]])
    ours = replay(lambda: make_speculator(SpecConfig("lookup", ngram_min=1), None), rows, 128)
    theirs = transformers_lookup_replay([p for p, _ in rows], [o for _, o in rows], 128, 15, [999])
    assert ours >= 1.25 * theirs["tokens_per_forward"], (ours, theirs)
