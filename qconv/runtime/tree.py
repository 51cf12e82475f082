"""Token-tree speculation for prompt lookup (greedy): several lookup continuations merged into a trie and scored in
one forward with a tree attention mask (SpecInfer token trees, REST / lookahead decoding's n-gram branch).

Why: one lookup candidate per step hits the first draft position only ~50% of the time on a copy and ~25% on code;
the other occurrences of the matched n-gram, and of shorter ones, often hold the token the model really produces.
Each node gets an estimated probability of being accepted (its parent's times the running hit rate of its kind:
source n-gram length, rank among its siblings, depth), and the controller verifies the best-first prefix of the
nodes that maximizes expected tokens per unit of measured forward cost. After the forward the accepted root-to-leaf
path is compacted into contiguous cache rows, so the cache looks as if that path had been decoded as a chain."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from qconv.runtime.adaptive import HitStats, SpecController
from qconv.runtime.cpu_pack import EXACT_MAX_ROWS
from qconv.runtime.datastore import Datastore
from qconv.runtime.spec import History, PromptLookup
from qconv.runtime.textlookup import TextMatcher

TREE_DEPTH_KEYS = 8  # hit rates per depth 1..7, then one rate for all deeper nodes (fewer keys to learn)
# Before any evidence: a candidate's next token continues a run that has matched so far more often the longer the
# run (SmolLM2 copy/code/chat, first children per depth 1, 2, 3, 4+: ~.45-.75, .55-.85, .7-.85, .8-.95; with a flat
# 0.5 prior, deep nodes were predicted 3-5x too unlikely and the controller cut copies short); alternatives (later
# siblings) seldom hit. Estimates start here and move with the tree's own scored hits.
FIRST_CHILD_PRIOR, OTHER_CHILD_PRIOR = (0.5, 0.65, 0.75) + (0.85,) * (TREE_DEPTH_KEYS - 3), 0.15


class NodeKind(NamedTuple):
    """What a node's hit rate is keyed by (with its depth): the source of the candidate that created it (e.g.
    "tree4": prompt lookup matched on 4+ tokens, "ds3": the datastore on 3, "text32") and its rank among its
    siblings (0: the first child, 2: the third or later). POOLED as the source: every source at that rank."""

    source: str
    rank: int

    def pooled(self) -> NodeKind:
        return NodeKind(POOLED, self.rank)


POOLED = "*"


# Forward sizes (tree nodes + root) the controller picks among: few sizes, so the cost model measures each often.
TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128)


@dataclass
class TokenTree:
    """Node 0 is the root: the last accepted token (scored for the next position, not a draft). Nodes are kept in
    parent-before-child order, which is also the order of the rows written to the cache."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    keys: list[NodeKind] = field(default_factory=lambda: [NodeKind("", 0)])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    @classmethod
    def root(cls, token: int) -> TokenTree:
        return cls([token])

    def __len__(self) -> int:
        return len(self.tokens)

    def insert(self, continuation: list[int], kind: str, max_nodes: int) -> None:
        """Add a draft continuation below the root, sharing the prefix it has in common with earlier ones."""
        node = 0
        for tok in continuation:
            child = self.children[node].get(tok)
            if child is None:
                if len(self.tokens) >= max_nodes:
                    return
                child = len(self.tokens)
                rank = min(len(self.children[node]), 2)
                self.tokens.append(tok)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.keys.append(NodeKind(kind, rank))
                self.children.append({})
                self.children[node][tok] = child
            node = child

    def probs(self, stats: HitStats) -> list[float]:
        """Estimated P(node accepted) per node (root: 1), from the running hit rates."""
        p = [1.0]
        for i in range(1, len(self.tokens)):
            key, d = self.keys[i], self.depths[i]
            p.append(p[self.parents[i]] * stats.estimate(key, _pos(d), node_prior(stats, key, d)))
        return p

    def best(self, n: int, probs: list[float]) -> TokenTree:
        """The root and the n nodes most likely to be accepted (a tree: a child never beats its parent, and ties
        keep the parent first), re-indexed in parent-before-child order."""
        keep = sorted(sorted(range(1, len(self.tokens)), key=lambda i: (-probs[i], i))[:n])
        out = TokenTree.root(self.tokens[0])
        new = {0: 0}
        for i in keep:
            new[i] = len(out.tokens)
            par = new[self.parents[i]]
            out.tokens.append(self.tokens[i])
            out.parents.append(par)
            out.depths.append(self.depths[i])
            out.keys.append(self.keys[i])
            out.children.append({})
            out.children[par][self.tokens[i]] = new[i]
        return out

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth [T], ancestors [T, T] bool, a node being its own ancestor): what Transformer.forward(tree=)
        takes."""
        T = len(self.tokens)
        anc = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            if i:
                anc[i] = anc[self.parents[i]]
            anc[i, i] = True
        return torch.tensor(self.depths), anc

    def accept_greedy(self, best: list[int]) -> tuple[list[int], int]:
        """best: the target's argmax at every node. Returns the accepted path (node ids, root excluded) - the
        longest one whose every token is the target's argmax after its parent - and the target's next token
        after it."""
        path, node = [], 0
        while (child := self.children[node].get(best[node])) is not None:
            path.append(child)
            node = child
        return path, best[node]


def _pos(depth: int) -> int:
    return min(depth, TREE_DEPTH_KEYS) - 1


def node_prior(stats: HitStats, key: NodeKind, depth: int) -> float:
    """Where a kind's estimate starts: the rate of every kind at this depth and sibling rank on this stream (so a
    source seen for the first time on a chat starts at the chat's rate, not at a copy's), which itself starts at
    the depth priors."""
    return stats.estimate(key.pooled(), _pos(depth), _depth_prior(key, depth))


def _depth_prior(key: NodeKind, depth: int) -> float:
    return FIRST_CHILD_PRIOR[_pos(depth)] if key.rank == 0 else OTHER_CHILD_PRIOR


@dataclass
class _Pending:
    start: int  # sequence length when proposed: a node at depth d predicts seq[start + d - 1]
    tree: TokenTree
    node: int = 0  # deepest node known to lie on the produced sequence


@dataclass
class TreeScorer:
    """Scores every proposed tree (the full one, not just the verified part) against the tokens really produced:
    each child of a node on the produced path is a hit or a miss for its kind's running rate; the reported
    per-position hit rate counts one event per depth (hit = some candidate had the produced token)."""

    stats: HitStats
    pending: list[_Pending] = field(default_factory=list)

    def propose(self, start: int, tree: TokenTree) -> None:
        if len(tree) > 1:
            self.pending.append(_Pending(start, tree))

    def observe(self, seq: list[int]) -> None:
        keep = []
        for p in self.pending:
            t = p.tree
            while t.children[p.node] and p.start + t.depths[p.node] < len(seq):
                d = t.depths[p.node]
                target = seq[p.start + d]
                for tok, child in t.children[p.node].items():
                    key = t.keys[child]
                    self.stats.update(key, _pos(d + 1), tok == target, count=False,
                                      prior=node_prior(self.stats, key, d + 1))
                    self.stats.update(key.pooled(), _pos(d + 1), tok == target, count=False,
                                      prior=_depth_prior(key, d + 1))
                hit = t.children[p.node].get(target)
                self.stats.count(d, hit is not None)
                if hit is None:
                    break
                p.node = hit
            else:
                if t.children[p.node]:
                    keep.append(p)
        self.pending = keep


@dataclass
class TreeSpeculator:
    """One greedy speculative step with a lookup token tree: build, choose the size, verify, compact the cache."""

    lookup: PromptLookup
    ctl: SpecController
    max_nodes: int = 63  # draft nodes at most (one forward of up to max_nodes + 1 tokens)
    max_candidates: int = 24
    history: History | None = None  # other requests' text, a second source of candidates
    datastore: Datastore | None = None  # a corpus the user pointed at (retrieval drafting), a third
    exact: bool = False  # bit-exact vs decode steps (model.exact_rows): see `step`
    text: TextMatcher | None = None  # lookup on normalized text (the model rewrites the source's tokenization)
    pending: list[int] = field(default_factory=list)  # exact mode: drafts accepted on fused rows, to confirm
    corrections: int = 0  # pending tokens the exact recompute overturned
    stop: frozenset[int] = frozenset()  # end-of-sequence tokens: a tree drafting one is verified fully exactly
    scorer: TreeScorer = field(init=False)

    def __post_init__(self):
        self.scorer = TreeScorer(self.ctl.stats)

    def _candidates(self, seq: list[int], depth: int) -> list[tuple[list[int], str]]:
        """Every source's continuations with their kinds, interleaved by rank (each source's best first, then
        each one's second, ...), so the node budget does not go to one source's long tail before another's best."""
        lookup = []
        for cont, n in self.lookup.candidates(seq, depth, self.max_candidates):
            lookup.append((cont, f"tree{min(n, 4)}"))
            if self.lookup.aliases:
                lookup.append((self.lookup.normalized(cont), f"alias{min(n, 4)}"))
        sources = [lookup]
        if self.text is not None:
            sources.append([(cont, f"text{n}") for cont, n in self.text.candidates(seq, depth)])
        for kind, source in (("hist", self.history), ("ds", self.datastore)):
            if source is not None:
                sources.append([(c, f"{kind}{min(n, 6)}") for c, n in source.candidates(seq, depth,
                                                                                       self.max_candidates)])
        return [s[i] for i in range(max(map(len, sources))) for s in sources if i < len(s)]

    def propose(self, seq: list[int], depth: int, rows: int = 0) -> TokenTree:
        """The verified subtree of this step (the full candidate tree is handed to the scorer). `rows`: forward
        rows the step computes besides the tree (a chain of tokens to confirm), counted in the forward's size."""
        self.scorer.observe(seq)
        tree = TokenTree.root(seq[-1])
        for cont, kind in self._candidates(seq, depth):
            tree.insert(cont, kind, 4 * self.max_nodes)
        self.scorer.propose(len(seq), tree)
        probs = tree.probs(self.ctl.stats)
        # exact mode: no more rows than the Linears are batch-invariant for
        limit = min(self.max_nodes, EXACT_MAX_ROWS - rows - 1) if self.exact else self.max_nodes
        ranked = sorted(probs[1:], reverse=True)[:limit]
        n = self.ctl.choose_tree(ranked, TREE_SIZES, rows)
        return tree.best(n, probs)

    def step(self, model, cache, seq: list[int], max_depth: int, remaining: int) -> tuple[list[int], int, int]:
        """One forward. seq: the tokens produced so far (the last one not yet in the cache); `remaining`: how many
        more are wanted. Returns (the new tokens now final, the tree's depth, drafts accepted on its logits).

        In exact mode, scoring every tree node row by row costs ~2.4x a fused forward at 64 nodes. So only a chain
        of rows is exact: the tokens still to confirm (`pending`), the root, and the head of the tree's first path
        (see `_exact_head`); the other nodes share one fused attention call. A draft whose parent row is exact is
        decided for good. Deeper accepted drafts and the token after them are provisional: the next forward
        recomputes them as an exact chain in front of its own tree, confirming each against the exact logits of
        the one before (a near-tie that the fused rows rounded the other way is corrected there, and that
        forward's tree dropped). Every token returned and every cache row kept is what plain decoding computes.
        A tree that reaches `remaining` is verified fully exactly, so the last tokens do not wait a forward."""
        chain = [seq[-1]] + self.pending  # computed exactly this forward; all but the first still to confirm
        m, ctx = len(self.pending), seq + self.pending
        tree = self.propose(ctx, min(max_depth, remaining - m - 1), m if self.exact else 0)
        full = not self.exact or max(tree.depths) >= remaining - m - 1
        e = 0 if full else self._exact_head(tree)
        start = int(cache.lengths[0])
        t0 = time.perf_counter()
        tokens = chain[:-1] + tree.tokens
        layout = _with_chain(tree, m) if len(tokens) > 1 else None
        x = torch.tensor([tokens], dtype=torch.long, device=model.device)
        logits = model(x, cache, tree=layout, exact=self.exact and full,
                       exact_prefix=None if full else m + 1 + e)[0]
        best = _argmax_rows(logits)
        for j in range(m):
            if best[j] != chain[j + 1]:  # a provisional token was a fused-rounding artifact
                cache.rollback([0], [start + j + 1])
                self.pending = []
                self.corrections += 1
                return chain[1:j + 1] + [best[j]], 0, 0
        path, nxt = tree.accept_greedy(best[m:])
        self.ctl.cost.observe(len(tokens), time.perf_counter() - t0)
        if len(tree) > 1:
            self.ctl.verified(len(path))
        new = [tree.tokens[i] for i in path] + [nxt]
        # Accepted nodes computed exactly: the path's head along the first path (nodes 1..e), or all when full.
        k = len(path) if full else next((i for i, node in enumerate(path) if node != i + 1 or node > e), len(path))
        if k == len(path):  # every decision came from an exact row
            cache.compact(0, start, list(range(m + 1)) + [m + i for i in path])
            self.pending = []
            return chain[1:] + new, max(tree.depths), len(path)
        cache.rollback([0], [start + m + 1 + k])
        self.pending = new[k + 1:]
        return chain[1:] + new[:k + 1], max(tree.depths), len(path)

    def _exact_head(self, tree: TokenTree) -> int:
        """How many nodes of the tree's first path (nodes 1, 2, ... while each is its predecessor's child) to
        score exactly: up to the parent of an end-of-sequence node on it, so that the end is final in this
        forward; else none (an exact row costs ~10x a fused one, ~100 us per layer here, and accepted drafts
        are recomputed exactly next forward anyway)."""
        for i in range(1, len(tree)):
            if tree.parents[i] != i - 1:
                break
            if tree.tokens[i] in self.stop:
                return i - 1
        return 0


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Per-row argmax (the first maximum, as torch's): numpy's is ~6x faster than torch's on CPU for [T, 49152]."""
    return (logits.numpy().argmax(-1) if logits.device.type == "cpu" else logits.argmax(-1)).tolist()


def _with_chain(tree: TokenTree, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of m chain tokens followed by `tree` (whose root follows the chain's last token)."""
    depth, anc = tree.layout()
    if not m:
        return depth, anc
    T = m + len(tree)
    full = torch.zeros(T, T, dtype=torch.bool)
    full[:m + 1, :m + 1] = torch.ones(m + 1, m + 1, dtype=torch.bool).tril()
    full[m:, :m] = True
    full[m:, m:] = anc
    return torch.cat([torch.arange(m), depth + m]), full
