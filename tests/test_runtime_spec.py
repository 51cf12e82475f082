"""Speculative decoding, sampling and generation: lossless greedy, distribution-preserving rejection sampling,
prompt lookup, the adaptive controller; first on a toy model implementing the runtime API, then on real models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from qconv.runtime.adaptive import CostModel, HitStats, ShadowScorer, SpecController
from qconv.runtime.generate import GenerationConfig, GenerationStats, generate_tokens, stream_text
from qconv.runtime.sampling import (SamplingParams, probs_from_logits, sample_next, verify_greedy,
                                    verify_sampling)
from qconv.runtime.spec import PromptLookup


# --- a toy model with the runtime API: next-token logits depend on the last two tokens; rollback cuts lengths ---
class ToyCache:
    def __init__(self, max_batch, max_len):
        self.lengths = torch.zeros(max_batch, dtype=torch.long)
        self.tokens = torch.zeros(max_batch, max_len, dtype=torch.long)

    def rollback(self, slots, n_keep):
        for s, n in zip(slots.tolist(), n_keep.tolist()):
            assert 0 <= n <= int(self.lengths[s])
            self.lengths[s] = n

    def reset(self, slots):
        self.lengths[slots] = 0


class ToyMTP:
    """Predicts from the embedding of the next token and the hidden state; keeps a cache like the real one."""

    def __init__(self, vocab, hidden, g):
        self.table = torch.randn(vocab, vocab, generator=g) * 2
        self.mix = torch.randn(hidden, vocab, generator=g)
        self.emb = torch.randn(vocab, hidden, generator=g)

    def new_cache(self, max_batch, max_len):
        return ToyCache(max_batch, max_len)

    def __call__(self, hidden, next_tokens, cache, slots=None):
        B, T = next_tokens.shape
        cache.lengths[:B] += T
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

    def new_cache(self, max_batch, max_len, kv_scheme="none"):
        return ToyCache(max_batch, max_len)

    def __call__(self, tokens, cache, slots=None, return_hidden=False, exact=False):
        B, T = tokens.shape
        slots = torch.arange(B) if slots is None else slots
        self.forwards.append(T)
        logits, hidden = [], []
        for b, s in enumerate(slots.tolist()):
            n = int(cache.lengths[s])
            cache.tokens[s, n:n + T] = tokens[b]
            cache.lengths[s] = n + T
            hist = cache.tokens[s, : n + T]
            prev = torch.cat([hist.new_zeros(1), hist[:-1]])[n:]
            key = prev * self.vocab + hist[n:]
            logits.append(self.table[key])
            hidden.append(self.hid[key])
        logits = torch.stack(logits)
        return (logits, torch.stack(hidden)) if return_hidden else logits


def plain(model, prompt, cfg):
    return list(generate_tokens(model, prompt, GenerationConfig(**{**cfg.__dict__, "spec": "none"})))


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
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0.0, generator=g).tolist() == [3, 0]
    draws = torch.stack([sample_next(logits, 1.0, top_k=1, generator=g) for _ in range(20)])
    assert (draws == torch.tensor([3, 0])).all()


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


# --- prompt lookup ---
def test_lookup_longest_most_recent_and_periodic():
    lk = PromptLookup(max_ngram=3, min_ngram=1)
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]
    # suffix [6, 7]: most recent earlier occurrence is at index 6 -> continuation 3, 4, 2, ...
    assert lk.propose(seq, 3).tokens == [3, 4, 2]
    assert lk.match(seq) == (8, 2)
    seq2 = seq + [8]  # suffix [6, 7, 8] (n=3) matches only at the start even though [7, 8] ... -> 9, 1
    assert lk.propose(seq2, 2).tokens == [9, 1]
    assert PromptLookup().propose([1, 2, 3], 4).tokens == []  # no earlier occurrence of any suffix
    # a copy in progress: source [9, 5, 1, 7, 5, 2, 8], output so far [9, 5, 1] -> continues at 7 (cursor)
    src = [0, 9, 5, 1, 7, 5, 2, 8, 3]
    lk3 = PromptLookup(max_ngram=2)
    assert lk3.propose(src + [9, 5], 2).tokens == [1, 7]
    # the output substituted 4 for 7 and goes on: "5" alone matches 3 places; the copy position wins
    assert lk3.propose(src + [9, 5, 1, 4, 5], 2).tokens == [2, 8]
    assert PromptLookup(max_ngram=2).propose(src + [9, 5, 1, 4, 5], 2).tokens == [1, 4]  # no cursor: most recent
    lk2 = PromptLookup(max_ngram=2)
    assert lk2.propose([4, 1, 2, 1, 2], 5).tokens == [1, 2, 1, 2, 1]  # a loop keeps repeating past the end
    assert lk2.propose([4, 1, 2, 1], 2, extra=[2]).tokens == [1, 2]  # suffix of sequence + drafted tokens


# --- adaptive controller ---
def test_controller_backs_off_and_grows_after_saturation():
    ctl = SpecController(base=4, max_block=15)
    for _ in range(40):
        ctl.stats.update("lookup1", 0, False)
    assert ctl.choose(["lookup1"] * 8) == 0  # drafts that never hit are not worth a wider forward
    for i in range(15):
        for _ in range(40):
            ctl.stats.update("lookup4", i, True)
    assert ctl.choose(["lookup4"] * 15) == 4  # capped at the base block
    ctl.after_step(4, 4)
    ctl.after_step(8, 8)
    assert ctl.cap == 15 and ctl.choose(["lookup4"] * 15) == 15
    ctl.after_step(15, 3)
    assert ctl.cap == 4


def test_controller_scales_expected_gains_by_what_verified_steps_really_accepted():
    ctl = SpecController(base=15, max_block=15)
    for T in (1, 4, 8, 16):
        ctl.cost.observe(T, 0.1 * T ** 0.5)
    assert ctl.stats.calibration(1.8) == 1.0  # no evidence yet
    probs = [0.6] * 3
    assert ctl.choose_tree(probs, (1, 4, 8, 16)) == 3 and ctl.predicted == pytest.approx(1.8)
    for _ in range(20):  # the estimates are optimistic on this text: ~2 predicted, none accepted
        ctl.after_step(3, 0)
        ctl.predicted = 1.8
    assert ctl.stats.calibration(1.8) < 0.25 and ctl.stats.calibration(5.0) == 1.0  # per band of prediction
    assert ctl.choose_tree(probs, (1, 4, 8, 16)) == 0  # the same tree no longer pays
    for _ in range(60):  # and pessimistic on the next one
        ctl.stats.calibrate(0.9, 2)
    assert ctl.stats.calibration(0.9) > 1.8  # the old steps have faded
    assert ctl.choose_tree([0.3] * 3, (1, 4, 8, 16)) == 3  # a tree that pays only at the measured rate
    assert SpecController(base=15, max_block=15, cost=ctl.cost).choose_tree([0.3] * 3, (1, 4, 8, 16)) == 0


def test_cost_model_fits_a_power_law_to_wider_forwards():
    cm = CostModel(prior_slope=0.1)
    assert cm.relative(5) == pytest.approx(1.4)  # prior until a decode step is measured
    cm.observe(1, 0.2)
    cm.observe(4, 0.32)
    assert cm.relative(4) == pytest.approx(1.6) and cm.relative(3) == pytest.approx(1.4)  # one wider size: linear
    assert cm.relative(6) == pytest.approx(1.8)  # past it: optimistic prior slope
    for T, sec in ((16, 0.44), (1, 0.2)):
        cm.observe(T, sec)
    assert cm.relative(4) == pytest.approx(1.6) and cm.relative(16) == pytest.approx(2.2)  # through both points
    assert cm.relative(8) == pytest.approx(0.32 * 2 ** (math.log(0.44 / 0.32) / math.log(4)) / 0.2)
    for T, sec in ((8, 0.9), (32, 0.5), (64, 0.6)):  # a noisy spike at T=8 does not make T=8 cost more than T=64
        cm.observe(T, sec)
    assert cm.relative(8) < cm.relative(32) < cm.relative(64) < 0.6 / 0.2 * 1.2
    cm.observe(16, 0.9)  # recent observations count more
    assert cm.relative(16) > 2.2


def test_shadow_scorer_counts_hits_per_position():
    stats = HitStats()
    sc = ShadowScorer(stats)
    sc.propose(3, [7, 8, 9], ["a"] * 3)
    sc.observe([0, 1, 2, 7, 8])
    assert stats.reached[:3] == [1, 1, 0] and stats.hits[:2] == [1, 1]
    sc.observe([0, 1, 2, 7, 8, 4])
    assert stats.reached[:3] == [1, 1, 1] and stats.hits[2] == 0 and not sc.pending


# --- generation on the toy model ---
TOY_PROMPTS = [[(3 * i + j * j) % 10 + 2 for j in range(6 + i % 5)] * (1 + i % 3) for i in range(20)]


@pytest.mark.parametrize("spec", ["lookup", "mtp", "hybrid"])
def test_toy_greedy_speculative_equals_plain(spec):
    model = ToyModel()
    for adaptive in (True, False):
        cfg = GenerationConfig(max_tokens=40, spec=spec, adaptive=adaptive)
        for prompt in TOY_PROMPTS:
            stats = GenerationStats()
            out = list(generate_tokens(model, prompt, cfg, stats))
            assert out == plain(model, prompt, cfg)
            assert stats.new_tokens == len(out)


def test_toy_speculation_saves_forwards_on_repetitive_output():
    model = ToyModel(eos=99)  # no eos: the toy chain falls into a loop lookup can copy
    cfg = GenerationConfig(max_tokens=120, spec="lookup", adaptive=False)  # adaptive choices depend on timing
    stats = GenerationStats()
    out = list(generate_tokens(model, TOY_PROMPTS[0], cfg, stats))
    assert out == plain(model, TOY_PROMPTS[0], cfg)
    assert stats.tokens_per_step > 2.0, stats.to_dict()
    d = stats.to_dict()
    assert len(d["acceptance_per_position"]) == 15 and d["acceptance_per_position"][-1] > 0  # full blocks taken
    assert all(0 <= r <= 1 for r in d["drafter_hit_rate_per_position"])


def test_toy_sampling_distribution_preserved():
    """End to end: the third generated token follows the exact marginal of the model. The second step verifies a
    block of one MTP draft (a sampled q) and one prompt-lookup draft (a point mass)."""
    model = ToyModel(vocab=5, eos=99, seed=3)
    prompt = [0, 1, 2, 3, 4, 1, 0, 4, 3, 2]  # every token has an earlier occurrence: lookup always matches
    sp = SamplingParams(temperature=1.0)
    p = lambda a, b: torch.softmax(model.table[a * 5 + b], -1)  # noqa: E731
    p1 = p(3, 2)
    exact = sum(p1[a] * p(2, a)[b] * p(a, b) for a in range(5) for b in range(5))
    counts = torch.zeros(5)
    N = 1000
    stats = GenerationStats()
    for seed in range(N):
        cfg = GenerationConfig(max_tokens=4, sampling=sp, spec="hybrid", seed=seed, adaptive=False, base_block=2,
                               mtp_k=1)
        counts[list(generate_tokens(model, prompt, cfg, stats))[2]] += 1
    assert stats.drafted[1] > N // 2  # two-token blocks were verified
    assert chisquare(counts.numpy(), (exact * N).numpy()).pvalue > 1e-3


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


# --- real models ---
class OracleDrafter:
    """Proposes the known greedy continuation with a wrong token at a varying position, so verification accepts
    every possible prefix length and the cache (KV and Gated-DeltaNet state) is rolled back to each of them."""

    needs_hidden = False

    def __init__(self, reference: list[int], prompt_len: int):
        self.ref, self.start, self.calls = reference, prompt_len, 0

    def begin(self, prompt, cache=None, max_len=0):
        pass

    def observe(self, hidden, next_tokens):
        pass

    def propose(self, seq, k, extra=(), budget=None):
        from qconv.runtime.spec import Draft

        done = len(seq) - self.start
        toks = list(self.ref[done:done + min(k, 6)])
        self.calls += 1
        bad = self.calls % 7
        if bad < len(toks):
            toks[bad] = (toks[bad] + 1) % 97
        return Draft(toks, ["oracle"] * len(toks), [None] * len(toks))


def _greedy_matches(model, prompts, spec, max_tokens, **kw):
    totals = GenerationStats()
    for ids in prompts:
        ref = list(generate_tokens(model, ids, GenerationConfig(max_tokens=max_tokens)))
        out = list(generate_tokens(model, ids, GenerationConfig(max_tokens=max_tokens, spec=spec, **kw), totals))
        assert out == ref, f"{spec} diverged from plain greedy on prompt {ids[:8]}..."
    return totals


@pytest.fixture(scope="module")
def qwen35_model(tiny_qwen3_5, one_thread):
    from qconv.runtime.loader import load_model, load_tokenizer

    model = load_model(tiny_qwen3_5)
    assert model.mtp is not None
    tok = load_tokenizer(tiny_qwen3_5)
    prompts = [tok(f"def add{i}(a, b):\n    return a + b {i} the quick brown fox")["input_ids"] for i in range(20)]
    return model, prompts


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["mtp", "hybrid"])
def test_qwen35_greedy_speculative_equals_plain(qwen35_model, spec):
    model, prompts = qwen35_model
    stats = _greedy_matches(model, prompts, spec, max_tokens=10)
    assert stats.drafted[0] > 0  # the drafts were really verified (random MTP weights: mostly rejected)


def test_qwen35_rollback_at_every_accept_length(qwen35_model, monkeypatch):
    import qconv.runtime.generate as gen_mod

    model, prompts = qwen35_model
    for ids in prompts[:4]:
        ref = list(generate_tokens(model, ids, GenerationConfig(max_tokens=24)))
        oracle = OracleDrafter(ref, len(ids))
        monkeypatch.setattr(gen_mod, "make_drafter", lambda *a, **k: oracle)
        stats = GenerationStats()
        out = list(generate_tokens(model, ids, GenerationConfig(max_tokens=24, spec="lookup", adaptive=False,
                                                                base_block=6), stats))
        assert out == ref
        assert stats.tokens_per_step > 1.5 and stats.accepted[3] > 0  # long accepted runs were rolled back into


@pytest.mark.slow
def test_smollm2_lookup_greedy_equals_plain(smollm2, shared_data, one_thread, monkeypatch):
    """Token trees (SmolLM2 is attention-only with a dense KV cache: greedy lookup verifies trees)."""
    from qconv.runtime.generate import encode_prompt
    from qconv.runtime.loader import load_model, load_tokenizer
    from qconv.runtime.spec import punctuation_aliases
    from qconv.runtime.tree import TokenTree

    model, tok = load_model(smollm2), load_tokenizer(smollm2)
    lines = [s.strip() for s in (shared_data / "tinyshakespeare.txt").read_text().split("\n\n")[1:80]]
    texts = [s.replace("\n", " ")[:160] for s in lines if len(s) > 60][:20]
    prompts = [encode_prompt(tok, "Repeat exactly: " + t, chat=True) for t in texts]
    assert len(prompts) == 20
    branching, accept = [], TokenTree.accept_greedy
    monkeypatch.setattr(TokenTree, "accept_greedy", lambda t, lg: branching.append(len(t.children[0])) or
                        accept(t, lg))
    stats = _greedy_matches(model, prompts, "lookup", max_tokens=12, lookup_aliases=punctuation_aliases(tok))
    assert stats.tokens_per_step > 1.2, stats.to_dict()  # copying pays even in 12 tokens
    assert max(branching) > 1  # trees with several first-token candidates were verified


# --- CLI ---
def test_cli_generate_and_bench(tiny_llama, tmp_path, one_thread):
    from click.testing import CliRunner

    from qconv.cli import main

    r = CliRunner().invoke(main, ["generate", str(tiny_llama), "--chat", "the quick brown fox", "--max-tokens", "6",
                                  "--spec", "lookup", "--stats"])
    assert r.exit_code == 0, r.output
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(f'{{"turns": ["print add {i} and the quick brown fox"]}}\n' for i in range(3)))
    r = CliRunner().invoke(main, ["bench", str(tiny_llama), "--workload", "chat", "--data", str(data), "--prompts",
                                  "2", "--max-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    import json

    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["prompts"] == 2 and rep["ours"]["identical_to_plain"] is True and rep["ours"]["new_tokens"] > 0
    r = CliRunner().invoke(main, ["bench", str(tiny_llama), "--workload", "chat", "--data", str(data), "--prompts",
                                  "2", "--max-tokens", "8", "--json", "--history", "1"])
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["history_warmup_prompts"] == 1 and rep["ours"]["identical_to_plain"] is True
    r = CliRunner().invoke(main, ["bench", str(tiny_llama), "--workload", "chat", "--data", str(data), "--prompts",
                                  "1", "--max-tokens", "8", "--json", "--tolerance", "0"])
    assert r.exit_code == 0 and json.loads(r.output.strip().splitlines()[-1])["tolerance"] == 0, r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_llama), "--workload", "chat", "--data", str(data), "--prompts",
                                  "1", "--max-tokens", "8"])
    assert r.exit_code == 0 and "transformers' drafter" in r.output and "tokens/step" in r.output, r.output
    r = CliRunner().invoke(main, ["generate", str(tiny_llama), "--prompt", "x", "--tolerance", "1"])
    assert r.exit_code == 2 and "--tolerance 1.0 out of range" in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_llama), "--workload", "code", "--data", str(data)])
    assert r.exit_code == 2 and "'prompt' field" in r.output  # a chat file given to the code workload
    r = CliRunner().invoke(main, ["generate", str(tmp_path), "--prompt", "x"])
    assert r.exit_code == 2 and "no config.json" in r.output


def test_transformers_drafter_replay_reproduces_its_real_run(tiny_llama, one_thread):
    """The replay of transformers' prompt-lookup drafter on our greedy outputs counts the forwards its real
    `generate(prompt_lookup_num_tokens=...)` run takes when both engines produce the same text (fp32)."""
    from qconv.runtime.bench import _transformers, transformers_lookup_replay
    from qconv.runtime.loader import load_model

    model = load_model(tiny_llama, dtype=torch.float32)
    eos = list(model.config.eos_token_ids)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(4)]  # the random model loops
    outputs = [list(generate_tokens(model, p, GenerationConfig(max_tokens=24))) for p in prompts]
    real = _transformers(tiny_llama, prompts, 24, 15, eos, torch.float32)
    replay = transformers_lookup_replay(prompts, outputs, 24, 15, eos)
    assert real["new_tokens"] == replay["new_tokens"] == sum(map(len, outputs))
    assert replay["tokens_per_forward"] == real["tokens_per_forward"] > 1.5, (real, replay)
