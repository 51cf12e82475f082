"""Reference storage and metrics on tiny models: the top-k bracket holds against the exact KLD, fp16 full storage
is faithful, KV simulation reaches every full-attention layer, gates/regressions/JUnit say what failed."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from qconv.errors import QconvError
from qconv.eval.gates import apply_gates, regressions, tier_info, write_junit
from qconv.eval.kvsim import SimulatedKV, get_scheme, kv_simulation
from qconv.eval.metrics import TokenStats, kld_topk, summarize
from qconv.eval.reference import ref_window_from_logits, window_logits
from qconv.eval.report import summary
from qconv.eval.text import HeldOutText, load_text, make_windows
from qconv.recipes.sections import Gates, GateTier, Quality, Regression
from tests.tiny import CORPUS


def _logits(folder, ids):
    from qconv.convert.hfmodel import load_causal_lm

    return window_logits(load_causal_lm(folder), ids, 0)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama):
    """Source logits and logits of a visibly different model (the source with noised weights) on one window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(CORPUS, add_special_tokens=False)["input_ids"][:256]
    base, targets = _logits(tiny_llama, ids)
    m = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
    q, _ = window_logits(m, ids, 0)
    return base, q, targets


def _exact_kld(base, q):
    lp, lq = torch.log_softmax(base.double(), -1), torch.log_softmax(q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("k", [4, 32, 128])
def test_topk_reference_brackets_exact_kld(tiny_pair, k):
    base, q, targets = tiny_pair
    exact = _exact_kld(base, q)
    est, lo, hi = kld_topk(ref_window_from_logits(base, targets, k), torch.log_softmax(q.float(), -1))
    tol = 1e-5  # fp32 storage of the top-k log-probs
    assert torch.all(est <= exact + tol) and torch.all(lo <= exact + tol) and torch.all(exact <= hi + tol)
    stats = TokenStats()
    stats.add(ref_window_from_logits(base, targets, k), q, targets)
    s = summarize(stats)
    assert s.kld_bound > 0
    # the stated bound on the mean holds
    assert s.kld_mean - tol <= exact.mean().item() <= s.kld_mean + s.kld_bound + tol
    # the bound tightens as k grows and top-1 / PPL do not depend on k
    full = TokenStats()
    full.add(ref_window_from_logits(base, targets, None), q, targets)
    f = summarize(full)
    assert s.top1 == f.top1 and s.ppl_base == pytest.approx(f.ppl_base, rel=1e-6)


def test_topk_bound_shrinks_with_k(tiny_pair):
    base, q, targets = tiny_pair
    bounds = []
    for k in (4, 64, 256):
        st = TokenStats()
        st.add(ref_window_from_logits(base, targets, k), q, targets)
        bounds.append(summarize(st).kld_bound)
    assert bounds[0] > bounds[1] > bounds[2]


def test_full_fp16_reference_matches_exact(tiny_pair):
    base, q, targets = tiny_pair
    st = TokenStats()
    st.add(ref_window_from_logits(base, targets, None), q, targets, chunk=50)  # chunking must not matter
    s = summarize(st)
    exact = _exact_kld(base, q).numpy()
    assert s.kld_mean == pytest.approx(exact.mean(), rel=2e-3)
    assert s.kld_p99 == pytest.approx(np.quantile(exact, 0.99), rel=5e-3)
    assert s.tokens == len(targets) and s.kld_bound == 0
    assert s.ppl_ratio == pytest.approx(np.exp(s.ln_ppl_ratio))


def test_text_errors(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    short = HeldOutText("short", "hello world")
    with pytest.raises(QconvError, match="shorter than one window"):
        make_windows(tok, short, window=64)
    with pytest.raises(QconvError, match="not found"):
        load_text(tmp_path / "missing.txt")
    w = make_windows(tok, HeldOutText("c", CORPUS), window=64, stride=32, max_tokens=200)
    assert [len(x) for x in w.ids] == [64] * len(w.ids) and w.first_scored(1) == 32
    assert w.num_scored == 63 + 31 * (len(w.ids) - 1)


@pytest.mark.parametrize("family,n_full", [("llama", 2), ("qwen3_5", 2)])
def test_kv_simulation_reaches_full_attention_layers(tiny_models, family, n_full):
    from qconv.convert.hfmodel import load_causal_lm

    model = load_causal_lm(tiny_models(family))
    ids = list(range(3, 200))
    calls = []

    fp8 = get_scheme("fp8_e4m3").scheme

    class Counting:
        name = "fp8_counting"

        def fake_quant(self, k, v):
            calls.append(tuple(k.shape))
            return fp8.fake_quant(k, v)

    base, _ = window_logits(model, ids, 0)
    with kv_simulation(model, SimulatedKV(Counting(), "prefill")):
        kv, _ = window_logits(model, ids, 0)
    after, _ = window_logits(model, ids, 0)
    assert len(calls) == n_full and all(c[2] == len(ids) for c in calls)
    assert not torch.equal(base, kv)  # fp8 changed something
    assert torch.equal(base, after)  # and the model is restored afterwards
    assert _exact_kld(base, kv).mean() < 0.05


def test_decode_form_in_query_chunks_is_one_masked_call_over_both_copies(monkeypatch):
    """The decode form's attention, query chunk by query chunk over only the columns a chunk attends to, gives what
    one masked SDPA call over the quantized and the exact copy (2T keys) gives, within float rounding."""
    import types

    from transformers import AttentionInterface

    from qconv.eval import kvsim

    sim = get_scheme("kvarn_k4v2_g128")
    attention = AttentionInterface._global_mapping[kvsim._register(sim)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 300, 64, generator=g),
        torch.randn(1, 2, 300, 64, generator=g),
        torch.randn(1, 2, 300, 64, generator=g),
    )
    keys, values, allowed = sim.scheme.decode_time(k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=allowed, scale=0.125
    ).transpose(1, 2)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    for chunk in (64, 100, 1 << 20):
        monkeypatch.setattr(kvsim, "QUERY_CHUNK", chunk)
        got, _ = attention(module, q, k, v, None, dropout=0.0, scaling=0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unknown_kv_scheme():
    with pytest.raises(QconvError, match="unknown KV"):
        get_scheme("fp3_nonsense")


def _report(kld=0.1, p99=1.0, top1=0.8, ratio=1.1, kv=True):
    """An EvalReport (from a seeded quality summary) with the given weights metrics; weights + KV 20% worse."""
    from dataclasses import replace

    from tests.eval_helpers import eval_report

    base = eval_report()
    w = replace(base.weights, kld_mean=kld, kld_p99=p99, top1=top1, ppl_ratio=ratio)
    return replace(base, weights=w, weights_kv=replace(w, kld_mean=kld * 1.2) if kv else None)


def test_gates_regression_and_junit(tmp_path):
    tier = GateTier("t", 0, weights=Gates(max_mean_kld=0.2, min_top1=0.85), weights_kv=Gates(max_mean_kld=0.11))
    v = {x.name: x for x in apply_gates(_report(), tier)}
    assert v["weights.max_mean_kld"].passed and not v["weights.min_top1"].passed
    assert not v["weights_kv.max_mean_kld"].passed and "measured 0.1200" in v["weights_kv.max_mean_kld"].message
    assert "weights_kv.max_mean_kld" not in {x.name for x in apply_gates(_report(kv=False), tier)}

    reg = regressions(_report(kld=0.12), summary(_report(kld=0.1)), Regression(mean_kld_rel=0.1))
    failed = [r for r in reg if not r.passed]
    assert {r.name.split(" ")[0] for r in failed} == {"weights.kld_mean", "weights_kv.kld_mean"}
    assert all(r.passed for r in regressions(_report(), summary(_report()), Regression()))

    path = tmp_path / "j.xml"
    write_junit(path, list(v.values()))
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite.get("failures") == "2" and suite.get("tests") == str(len(v))
    assert any("min_top1" in (f.get("message") or "") for f in suite.iter("failure"))


def test_tier_info_says_outside_target_class():
    q = Quality(tiers=[GateTier("target", 7e9), GateTier("small", 0)])
    info = tier_info(q, 135_000_000)
    assert info.name == "small" and not info.in_target_class and info.note and "outside" in info.note
    assert tier_info(q, 27_000_000_000).in_target_class
