"""Token-tree speculation: the trie and its ranking, the tree attention mask (every node's logits equal those of
its root-to-node path run as a plain chain), KV compaction after accepting a non-first branch, lookup candidates
and punctuation aliases, and greedy tree decoding == plain greedy."""

from __future__ import annotations

import pytest
import torch

from qconv.errors import QconvError
from qconv.runtime.adaptive import HitStats, SpecController
from qconv.runtime.generate import GenerationConfig, GenerationStats, generate_tokens
from qconv.runtime.spec import History, PromptLookup
from qconv.runtime.tree import POOLED, NodeKind, TokenTree, TreeScorer, node_prior


def _tree(root: int, branches: list[list[int]]) -> TokenTree:
    t = TokenTree.root(root)
    for b in branches:
        t.insert(b, "tree4", 100)
    return t


# --- the trie ---
def test_trie_shares_prefixes_and_ranks_siblings():
    t = _tree(7, [[1, 2, 3], [1, 2, 4], [5, 6]])
    assert t.tokens == [7, 1, 2, 3, 4, 5, 6]
    assert t.parents == [-1, 0, 1, 2, 2, 0, 5] and t.depths == [0, 1, 2, 3, 3, 1, 2]
    assert t.keys[3] == NodeKind("tree4", 0) and t.keys[4] == t.keys[5] == NodeKind("tree4", 1)
    depth, anc = t.layout()
    assert depth.tolist() == t.depths
    assert anc[4].nonzero().flatten().tolist() == [0, 1, 2, 4] and anc[6].nonzero().flatten().tolist() == [0, 5, 6]
    t.insert([9, 9, 9], "tree1", 8)  # the node budget stops the insertion
    assert len(t) == 8


def test_best_nodes_form_a_tree_and_accept_greedy_walks_it():
    t = _tree(7, [[1, 2, 3], [5, 6]])
    stats = HitStats()
    stats.update(NodeKind("tree4", 1), 0, True)  # siblings ranked 1 at depth 1 look better than the first candidate
    for _ in range(5):
        stats.update(NodeKind("tree4", 0), 0, False)
    probs = t.probs(stats)
    sub = t.best(2, probs)
    assert sub.tokens == [7, 5, 6] and sub.parents == [-1, 0, 1]
    V = 10
    logits = torch.zeros(3, V)
    logits[0, 5] = logits[1, 6] = logits[2, 8] = 1.0  # accepts 5, 6, then the target says 8
    assert sub.accept_greedy(logits.argmax(-1).tolist()) == ([1, 2], 8)
    logits[0, 5], logits[0, 1] = 0.0, 1.0  # target wants 1: not in the subtree, nothing accepted
    assert sub.accept_greedy(logits.argmax(-1).tolist()) == ([], 1)


def test_tree_scorer_scores_every_candidate_against_the_produced_tokens():
    stats = HitStats()
    sc = TreeScorer(stats)
    seq = [0, 0, 7]
    sc.propose(len(seq), _tree(7, [[1, 2, 3], [5, 6]]))
    sc.observe(seq + [1])  # depth 1: "1" hit, "5" missed; depth 2 not produced yet
    assert stats.reached[0] == 1 and stats.hits[0] == 1 and len(sc.pending) == 1
    assert stats.rate[(NodeKind("tree4", 0), 0)] > 0.5 > stats.rate[(NodeKind("tree4", 1), 0)]
    sc.observe(seq + [1, 9])  # depth 2 missed: done
    assert stats.reached[1] == 1 and stats.hits[1] == 0 and not sc.pending


def test_a_new_kind_starts_at_the_streams_rate_for_its_depth_and_rank():
    stats = HitStats()
    assert node_prior(stats, NodeKind("ds3", 0), 1) == 0.5  # nothing seen yet: the depth prior
    sc = TreeScorer(stats)
    for i in range(30):  # first children of every kind keep missing (a chat)
        seq = [0, i + 100]
        sc.propose(len(seq), _tree(seq[-1], [[1, 2]]))
        sc.observe(seq + [9])
    assert stats.rate[(NodeKind(POOLED, 0), 0)] < 0.1
    assert node_prior(stats, NodeKind("ds3", 0), 1) < 0.1  # a kind never seen before starts there, not at 0.5
    assert _tree(5, [[1, 2]]).probs(stats)[1] < 0.1


def test_controller_grows_the_tree_only_while_it_pays():
    ctl = SpecController(max_block=15)
    for T in (1, 4, 8, 16, 32, 64):
        ctl.cost.observe(T, 0.1 * T ** 0.5)  # relative cost sqrt(T)
    sizes = (1, 4, 8, 16, 32, 64)
    assert ctl.choose_tree([0.05] * 63, sizes) == 0  # nothing likely: plain decode
    assert ctl.choose_tree([0.9] * 3 + [0.3] * 4 + [0.01] * 56, sizes) == 3  # T = 4
    assert ctl.choose_tree([0.9] * 63, sizes) == 63
    assert ctl.choose_tree([0.9] * 10, sizes) == 10  # the whole tree is always a candidate size
    ctl.tolerance = 0.1
    assert ctl.choose_tree([0.9] * 3 + [0.3] * 4 + [0.01] * 56, sizes) == 7  # within 10% of the best: larger
    ctl.adaptive = False
    assert ctl.choose_tree([0.05] * 10, sizes) == 10


# --- lookup candidates ---
def test_lookup_candidates_and_aliases():
    seq = [1, 2, 3, 9, 1, 2, 4, 8, 2, 5, 1, 2]
    cands = PromptLookup(4, 1).candidates(seq, 2, 8)
    assert cands[0] == ([4, 8], 2)  # the longest match, most recent
    assert ([3, 9], 2) in cands and ([5, 1], 1) in cands  # the other occurrences of "1 2" and of "2"
    lk = PromptLookup(4, 1, aliases={50: 5})  # token 50 (" ,") matches as 5 (",")
    seq = [1, 50, 2, 3, 7, 1, 5, 2]
    assert lk.propose(seq, 2).tokens == [3, 7]
    assert lk.normalized([50, 3]) == [5, 3]
    assert PromptLookup(4, 1).propose(seq, 2).tokens == [3, 7]  # only the 1-gram "2" matches without aliases


def test_history_candidates_longest_first_distinct_and_bounded():
    h = History(max_ngram=3, min_ngram=2, max_tokens=20)
    h.add([1, 2, 3, 4, 5])
    h.add([9, 2, 3, 7, 7, 8])
    h.add([5, 5, 1, 2, 3, 4, 6])
    # suffix "1 2 3": only sequences 0 and 2 have it (most recent first); "2 3" adds sequence 1's continuation
    assert h.candidates([0, 1, 2, 3], 2, 8) == [([4, 6], 3), ([4, 5], 3), ([7, 7], 2)]
    assert h.candidates([0, 2, 3], 2, 1) == [([4, 6], 2)]
    assert h.candidates([0, 3], 2, 8) == []  # single tokens do not match across requests
    h.add([8] * 6)  # over max_tokens: the oldest sequence goes, with its index entries
    assert len(h) <= 20 and h.candidates([1, 2, 3], 2, 8) == [([4, 6], 3), ([7, 7], 2)]


# --- the tree forward on a real (tiny) llama ---
def _chain_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 128)
    return model(torch.tensor([tokens]), cache)[0]


def test_tree_mask_matches_plain_chains(llama):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 300, (20,), generator=g).tolist()
    t = _tree(prefix[-1], [[11, 12, 13, 14], [11, 12, 21], [11, 31, 32], [41, 42, 43], [51]])
    cache = llama.new_cache(1, 128)
    llama(torch.tensor([prefix[:-1]]), cache)
    logits = llama(torch.tensor([t.tokens]), cache, tree=t.layout())[0]
    assert int(cache.lengths[0]) == len(prefix) - 1 + len(t)
    for i in range(len(t)):
        path, node = [], i
        while node > 0:
            path.append(t.tokens[node])
            node = t.parents[node]
        ref = _chain_logits(llama, prefix + path[::-1])[-1]
        assert (logits[i] - ref).abs().max() <= 1e-4, i


def test_compaction_after_a_non_first_branch(llama):
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 300, (17,), generator=g).tolist()
    t = _tree(prefix[-1], [[11, 12, 13, 14], [41, 42, 43], [11, 31, 32]])
    cache = llama.new_cache(1, 128)
    llama(torch.tensor([prefix[:-1]]), cache)
    start = int(cache.lengths[0])
    llama(torch.tensor([t.tokens]), cache, tree=t.layout())
    path = [t.children[0][11], t.children[t.children[0][11]][31]]  # the third branch: 11 -> 31
    cache.compact(0, start, [0] + path)
    assert int(cache.lengths[0]) == start + 3
    nxt = llama(torch.tensor([[32, 7]]), cache)[0]
    ref = _chain_logits(llama, prefix + [11, 31, 32, 7])[-2:]
    assert (nxt - ref).abs().max() <= 1e-4
    path = [t.children[0][41]]  # the second branch, one token
    cache = llama.new_cache(1, 128)
    llama(torch.tensor([prefix[:-1]]), cache)
    llama(torch.tensor([t.tokens]), cache, tree=t.layout())
    cache.compact(0, start, [0] + path)
    assert (llama(torch.tensor([[5]]), cache)[0, -1] - _chain_logits(llama, prefix + [41, 5])[-1]).abs().max() <= 1e-4


def test_tree_needs_an_attention_only_model(tiny_qwen3_5):
    from qconv.runtime.loader import load_model

    model = load_model(tiny_qwen3_5, dtype=torch.float32)
    cache = model.new_cache(1, 32)
    assert not cache.supports_tree
    with pytest.raises(QconvError, match="attention-only"):
        model(torch.tensor([[1, 2]]), cache, tree=_tree(1, [[2]]).layout())


def test_tiny_llama_tree_greedy_equals_plain(llama, monkeypatch):
    monkeypatch.setattr(llama.config, "eos_token_ids", [])  # the random model says eos early: run 40 tokens
    g = torch.Generator().manual_seed(2)
    prompts = []
    for _ in range(6):  # repetitive prompts, so lookup finds several candidates
        base = torch.randint(3, 300, (6,), generator=g).tolist()
        prompts.append(base * 3 + base[:2] + torch.randint(3, 300, (3,), generator=g).tolist() + base[:3])
    for adaptive in (False, True):
        stats = GenerationStats()
        for ids in prompts:
            ref = list(generate_tokens(llama, ids, GenerationConfig(max_tokens=40)))
            out = list(generate_tokens(llama, ids, GenerationConfig(max_tokens=40, spec="lookup",
                                                                    adaptive=adaptive), stats))
            assert out == ref
            hist = History()  # other requests' text as candidates too: still lossless
            hist.add(list(reversed(ids)) + ref)
            assert list(generate_tokens(llama, ids, GenerationConfig(max_tokens=40, spec="lookup", history=hist,
                                                                     adaptive=adaptive))) == ref
        if not adaptive:
            assert stats.drafted[1] > 0 and stats.hit_reached[0] > 0 and stats.forwards < stats.new_tokens, stats.to_dict()


# --- bit-exact verification in bf16 (model.exact_rows) ---
@pytest.fixture(scope="module")
def llama_bf16(tiny_llama):
    from qconv.runtime.cpu_pack import packing_available
    from qconv.runtime.loader import load_model

    if not packing_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN packed bf16 Linears are not available in this torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(tiny_llama, dtype=torch.bfloat16)
    torch.set_num_threads(n)


def _decode_steps(model, prefix: list[int], tokens: list[int], with_cache: bool = False):
    """Logits of `tokens` fed one per forward after `prefix`: what plain decoding computes."""
    cache = model.new_cache(1, 128)
    model(torch.tensor([prefix]), cache)
    logits = torch.stack([model(torch.tensor([[t]]), cache)[0, -1] for t in tokens])
    return (logits, cache) if with_cache else logits


def test_exact_verify_reproduces_decode_steps_bit_for_bit(llama_bf16):
    m = llama_bf16
    assert m.exact_verify
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 300, (21,), generator=g).tolist()
    t = _tree(prefix[-1], [[11, 12, 13, 14] + list(range(50, 70)), [11, 12, 21], [11, 31, 32], [41, 42, 43]])
    assert len(t) > 16  # past the RoPE-matrix size (a plain forward of this size would switch RoPE paths)
    cache = m.new_cache(1, 128)
    m(torch.tensor([prefix[:-1]]), cache)
    logits = m(torch.tensor([t.tokens]), cache, tree=t.layout(), exact=True)[0]
    kv, start = cache.kv, len(prefix) - 1
    for i in range(len(t)):  # every node, on the first path (a key prefix) or off it (its ancestors moved in)
        path, node = [], i
        while node > 0:
            path.append(t.tokens[node])
            node = t.parents[node]
        ref, ref_cache = _decode_steps(m, prefix[:-1], [prefix[-1]] + path[::-1], with_cache=True)
        assert torch.equal(logits[i], ref[-1]), i
        for layer in range(len(kv.k)):  # the tree's rows are back in tree order, as decoding writes them
            for ours, theirs in ((kv.k[layer], ref_cache.kv.k[layer]), (kv.v[layer], ref_cache.kv.v[layer])):
                assert torch.equal(ours[0, :, start + i], theirs[0, :, start + len(path)]), (i, layer)
    chain = prefix[-1:] + list(range(80, 100))
    cache = m.new_cache(1, 128)
    m(torch.tensor([prefix[:-1]]), cache)
    assert torch.equal(m(torch.tensor([chain]), cache, exact=True)[0], _decode_steps(m, prefix[:-1], chain))
    # exact_prefix: a chain of 3 pending tokens in front of the tree; only those rows and the root are exact
    from qconv.runtime.tree import _with_chain

    pending = [90, 91, 92]
    cache = m.new_cache(1, 128)
    m(torch.tensor([prefix[:-1]]), cache)
    tree = _tree(pending[-1], [[11, 12, 13], [21, 22]])
    logits = m(torch.tensor([prefix[-1:] + pending[:-1] + tree.tokens]), cache, tree=_with_chain(tree, 3),
               exact_prefix=4)[0]
    assert torch.equal(logits[:4], _decode_steps(m, prefix[:-1], prefix[-1:] + pending))


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (256, 128), (512, 128), (128, 256)])
def test_packed_bf16_linears_are_row_invariant_up_to_exact_max_rows(shape):
    """What exact mode rests on: a row's bits do not depend on how many rows share the GEMM, up to
    EXACT_MAX_ROWS (SmolLM2's shapes and the tiny test model's). Past it they may (SmolLM2's down_proj from 130)."""
    from qconv.runtime.cpu_pack import EXACT_MAX_ROWS, PackedLinear, packing_available

    if not packing_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN packed bf16 Linears are not available in this torch")
    g = torch.Generator().manual_seed(7)
    lin = PackedLinear(torch.randn(shape, generator=g).to(torch.bfloat16) * 0.05, None)
    x = torch.randn(EXACT_MAX_ROWS, shape[1], generator=g).to(torch.bfloat16)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = torch.cat([lin(x[i:i + 1]) for i in range(EXACT_MAX_ROWS)])
        for m in (2, 7, 16, 33, 64, 100, EXACT_MAX_ROWS):
            assert torch.equal(lin(x[:m]), rows[:m]), m
    finally:
        torch.set_num_threads(n)


def test_exact_verify_only_where_the_linears_are_batch_invariant(tiny_llama, tiny_qwen3_5):
    from qconv.runtime.loader import load_model

    assert not load_model(tiny_llama, dtype=torch.float32).exact_verify  # MKL's fp32 GEMM varies with rows
    assert not load_model(tiny_qwen3_5, dtype=torch.bfloat16).exact_verify  # chunked vs recurrent GDN


def test_bf16_greedy_speculation_equals_plain_greedy(llama_bf16, monkeypatch):
    monkeypatch.setattr(llama_bf16.config, "eos_token_ids", [])
    g = torch.Generator().manual_seed(4)
    stats = GenerationStats()
    for _ in range(6):
        base = torch.randint(3, 300, (5,), generator=g).tolist()
        ids = base * 4 + torch.randint(3, 300, (3,), generator=g).tolist() + base[:2]
        ref = list(generate_tokens(llama_bf16, ids, GenerationConfig(max_tokens=48)))
        for nodes in (63, 0):  # token trees and the linear chain
            cfg = GenerationConfig(max_tokens=48, spec="lookup", adaptive=False, tree_nodes=nodes)
            assert list(generate_tokens(llama_bf16, ids, cfg, stats)) == ref
    assert stats.forwards < stats.new_tokens


def test_bf16_provisional_drafts_are_confirmed_or_corrected(llama_bf16, monkeypatch):
    """In exact mode a tree's nodes past the root are scored with one fused attention call and the drafts they
    accept are provisional until the next forward recomputes them exactly (TreeSpeculator.step). Skew that fused
    call on purpose: provisional tokens get overturned, and the output must still be plain greedy's."""
    monkeypatch.setattr(llama_bf16.config, "eos_token_ids", [])
    g = torch.Generator().manual_seed(5)
    prompts = []
    for _ in range(4):
        base = torch.randint(3, 300, (6,), generator=g).tolist()
        prompts.append(base * 4 + torch.randint(3, 300, (3,), generator=g).tolist() + base[:2])
    refs = [list(generate_tokens(llama_bf16, ids, GenerationConfig(max_tokens=48))) for ids in prompts]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def skewed(q, k, v, attn_mask=None, **kw):  # tree rows only: not decode steps, exact rows or the prefill
        out = sdpa(q, k, v, attn_mask=attn_mask, **kw)
        return out * 1.5 if 1 < q.shape[2] < k.shape[2] else out

    corrections = []
    for skew in (False, True):
        if skew:
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", skewed)
        stats = GenerationStats()
        for ids, ref in zip(prompts, refs):
            cfg = GenerationConfig(max_tokens=48, spec="lookup", adaptive=False)
            assert list(generate_tokens(llama_bf16, ids, cfg, stats)) == ref
        assert stats.forwards < stats.new_tokens
        corrections.append(stats.corrections)
    assert corrections[1] > max(corrections[0], 2), corrections  # unskewed: only bf16's own near-ties
