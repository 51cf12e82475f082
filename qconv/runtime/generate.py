"""Single-request generation: prefill, then per step draft -> verify all k+1 positions in one forward -> accept ->
roll the cache back to the accepted length. Greedy prompt lookup on attention-only models verifies a token tree of
several lookup candidates instead (tree.py). Streams token ids (or text), stops on eos / stop strings / max tokens,
and records per-step statistics (tokens per step, acceptance and drafter hit rate per draft position)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from qconv.errors import QconvError
from qconv.runtime.adaptive import MAX_POS, CostModel, HitStats, ShadowScorer, SpecController
from qconv.runtime.datastore import Datastore, load_datastore
from qconv.runtime.sampling import SamplingParams, probs_from_logits, verify_greedy, verify_sampling
from qconv.runtime.spec import Draft, History, PromptLookup, make_drafter, punctuation_aliases
from qconv.runtime.textlookup import TextLookup
from qconv.runtime.tree import TreeSpeculator


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop: tuple[str, ...] = ()
    spec: str = "none"  # none | lookup | mtp | hybrid
    max_block: int = 15  # most draft tokens verified in one step
    base_block: int = 0  # block cap after a rejection; 0 = the MTP k (mtp/hybrid) or max_block (lookup)
    adaptive: bool = True  # trim drafts that do not pay for their verify cost (False: always verify the cap)
    # Verify the largest draft whose expected speed is within this of the best one's: fewer forwards per token
    # (what a GPU, where a wide verify costs about a decode step, turns into speed) while the calibrated estimate
    # stays above plain decode. SmolLM2, bf16, this CPU: copy 4.18 tokens/step at 2.2x (docs/BENCHMARKS.md).
    tolerance: float = 0.7
    tree_nodes: int = 63  # greedy lookup on attention-only models: verify a token tree of up to this many
    # draft nodes (0 = one linear draft chain, as for sampling, MTP/hybrid and packed KV stores)
    mtp_k: int = 4
    max_ngram: int = 4
    min_ngram: int = 1
    lookup_aliases: dict[int, int] | None = None  # spec.punctuation_aliases(tokenizer): lookup matches modulo these
    history: History | None = None  # shared across requests: token trees also draft from earlier requests' text,
    # and each finished request's prompt + output is added to it
    datastore: Datastore | None = None  # a tokenized corpus token trees also draft from (retrieval drafting)
    text_lookup: TextLookup | None = None  # token trees also look the prompt up as normalized text


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0  # target forwards, prefill included (it yields the first token)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: list[int] = field(default_factory=lambda: [0] * MAX_POS)  # steps that verified draft position i
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    hit_reached: list[int] = field(default_factory=lambda: [0] * MAX_POS)  # drafter proposals scored at position i
    hit_hits: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    corrections: int = 0  # exact mode: provisional tokens the next forward's exact logits overturned

    def record_step(self, drafted: int, accepted: int) -> None:
        self.forwards += 1
        for i in range(drafted):
            self.drafted[i] += 1
            self.accepted[i] += int(i < accepted)

    def merge(self, other: GenerationStats) -> None:
        for name in ("prompt_tokens", "new_tokens", "forwards", "prefill_s", "decode_s", "corrections"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted", "accepted", "hit_reached", "hit_hits"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.forwards, 1)

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        def ratios(num, den):
            return [round(a / b, 4) for a, b in zip(num, den) if b]

        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "forwards": self.forwards,
            "tokens_per_step": round(self.tokens_per_step, 4), "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4), "decode_tok_s": round(self.decode_tok_s, 2),
            "acceptance_per_position": ratios(self.accepted, self.drafted),
            "drafter_hit_rate_per_position": ratios(self.hit_hits, self.hit_reached),
            "corrections": self.corrections,
        }


def with_drafting(cfg: GenerationConfig, tokenizer, *, aliases: bool = True, text_lookup: bool = True,
                  datastore: list | None = None) -> GenerationConfig:
    """cfg with the drafting aids that need the tokenizer, where cfg does not set them already: punctuation
    aliases for prompt lookup, lookup on normalized text, and a datastore indexed from `datastore` paths."""
    if aliases and cfg.lookup_aliases is None:
        cfg = replace(cfg, lookup_aliases=punctuation_aliases(tokenizer))
    if text_lookup and cfg.text_lookup is None:
        cfg = replace(cfg, text_lookup=TextLookup(tokenizer))
    if datastore:
        cfg = replace(cfg, datastore=load_datastore(list(datastore), tokenizer, cfg.lookup_aliases))
    return cfg


def _forward(model, tokens: list[int], cache, need_hidden: bool, exact: bool = False):
    x = torch.tensor([tokens], dtype=torch.long, device=model.device)
    out = model(x, cache, return_hidden=need_hidden, exact=exact)
    return (out[0][0], out[1][0]) if need_hidden else (out[0], None)


def generate_tokens(model, prompt: list[int], cfg: GenerationConfig, stats: GenerationStats | None = None,
                    cost: CostModel | None = None, hits: HitStats | None = None) -> Iterator[int]:
    """Yield the new token ids for one prompt. Lossless: with temperature 0 the output equals plain greedy
    decoding token for token; with sampling it follows the target's processed distribution exactly. `cost`: a
    forward-cost model to keep learning across requests (verify cost vs size is a property of model + machine);
    `hits`: the drafters' hit rates likewise (how often each kind of candidate is right, on this model and traffic:
    a short request alone sees too few scored drafts to learn them)."""
    if not prompt:
        raise QconvError("empty prompt", fix="pass at least one token")
    stats = stats if stats is not None else GenerationStats()
    sp = cfg.sampling
    gen = torch.Generator().manual_seed(cfg.seed)
    drafter = make_drafter(cfg.spec, model, sp, gen, mtp_k=cfg.mtp_k, max_ngram=cfg.max_ngram,
                           min_ngram=cfg.min_ngram, aliases=cfg.lookup_aliases)
    need_hidden = bool(drafter is not None and drafter.needs_hidden)
    base = cfg.base_block or (cfg.mtp_k if cfg.spec in ("mtp", "hybrid") else cfg.max_block)
    ctl = SpecController(base=min(base, cfg.max_block), max_block=cfg.max_block, adaptive=cfg.adaptive,
                         tolerance=cfg.tolerance, cost=cost if cost is not None else CostModel(),
                         stats=hits if hits is not None else HitStats())
    reached0, hits0 = list(ctl.stats.reached), list(ctl.stats.hits)  # shared stats: report this request's only
    scorer = ShadowScorer(ctl.stats)
    eos = set(model.config.eos_token_ids)
    spare = max(cfg.max_block, cfg.tree_nodes) + 1  # cache rows a verify forward writes past the sequence
    max_len = len(prompt) + cfg.max_tokens + spare
    limit = getattr(model.config, "max_position_embeddings", max_len)
    if len(prompt) + cfg.max_tokens > limit:
        raise QconvError(f"prompt ({len(prompt)}) + max tokens ({cfg.max_tokens}) exceed the model's context "
                         f"({limit})", fix="shorten the prompt or lower --max-tokens")
    cache = model.new_cache(1, min(max_len, limit + spare))
    slot0 = torch.zeros(1, dtype=torch.long)
    exact = getattr(model, "exact_verify", False)  # verify forwards reproduce decode steps bit for bit
    tree = None
    if (cfg.tree_nodes > 0 and sp.greedy and isinstance(drafter, PromptLookup)
            and getattr(cache, "supports_tree", False)):
        tree = TreeSpeculator(drafter, ctl, max_nodes=cfg.tree_nodes, history=cfg.history,
                              datastore=cfg.datastore, exact=exact, stop=frozenset(eos),
                              text=cfg.text_lookup.start(prompt) if cfg.text_lookup is not None else None)
    stats.prompt_tokens += len(prompt)

    def pick(logits: torch.Tensor, draft: Draft) -> tuple[int, int]:
        if sp.greedy:
            return verify_greedy(draft.tokens, logits)
        p = probs_from_logits(logits, sp.temperature, sp.top_p, sp.top_k)
        return verify_sampling(draft.tokens, draft.probs, p, gen)

    seq = list(prompt)
    produced = 0
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, hidden = _forward(model, prompt, cache, need_hidden)
        _, tok = pick(logits[-1:], Draft())
        stats.record_step(0, 0)
        if drafter is not None:
            drafter.begin(prompt, cache, max_len)
            if need_hidden:
                drafter.observe(hidden, prompt[1:] + [tok])
        stats.prefill_s += time.perf_counter() - t0
        t_dec = time.perf_counter()
        new = [tok]
        try:
            while True:
                for t in new:
                    seq.append(t)
                    produced += 1
                    stats.new_tokens += 1
                    yield t
                    if t in eos or produced >= cfg.max_tokens:
                        return
                tok = seq[-1]
                draft = Draft()
                if tree is not None:
                    new, depth, n = tree.step(model, cache, seq, cfg.max_block, cfg.max_tokens - produced)
                    stats.record_step(depth, n)
                    continue
                if drafter is not None:
                    scorer.observe(seq)
                    # Model drafts cost a forward each: draft what the controller would verify (at least one,
                    # so their hit rate keeps being measured while speculation is backed off).
                    budget = max(1, ctl.choose(["mtp"] * cfg.mtp_k)) if need_hidden else None
                    full = drafter.propose(seq, min(cfg.max_block, cfg.max_tokens - produced - 1), budget=budget)
                    scorer.propose(len(seq), full.tokens, full.sources)
                    draft = full.truncate(ctl.choose(full.sources))
                n_before = int(cache.lengths[0])
                t1 = time.perf_counter()
                logits, hidden = _forward(model, [tok] + draft.tokens, cache, need_hidden, exact)
                n, nxt = pick(logits, draft)
                if n < len(draft):
                    cache.rollback(slot0, torch.tensor([n_before + 1 + n]))
                ctl.cost.observe(len(draft) + 1, time.perf_counter() - t1)
                ctl.after_step(len(draft), n)
                stats.record_step(len(draft), n)
                new = draft.tokens[:n] + [nxt]
                if need_hidden:
                    drafter.observe(hidden[: n + 1], new)
        finally:
            stats.decode_s += time.perf_counter() - t_dec
            if cfg.history is not None:
                cfg.history.add(seq)
            if tree is not None:
                stats.corrections += tree.corrections
            for i in range(MAX_POS):
                stats.hit_reached[i] += ctl.stats.reached[i] - reached0[i]
                stats.hit_hits[i] += ctl.stats.hits[i] - hits0[i]


def stream_text(tokenizer, tokens: Iterator[int], stop: tuple[str, ...] = ()) -> Iterator[str]:
    """Incremental detokenization: yield text as it becomes stable (no dangling partial UTF-8 characters), and
    stop at the first stop string (it and anything after it are not emitted)."""
    ids: list[int] = []
    emitted = ""
    hold = max((len(s) for s in stop), default=0)
    for t in tokens:
        ids.append(t)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            if cut > len(emitted):
                yield text[len(emitted):cut]
            if hasattr(tokens, "close"):
                tokens.close()  # finishes the generator now, so its statistics are final
            return
        safe = len(text) - hold + 1 if hold else len(text)  # keep back what could still start a stop string
        if safe > len(emitted):
            yield text[len(emitted):safe]
            emitted = text[:safe]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if len(text) > len(emitted):
        yield text[len(emitted):]


def generate_text(model, tokenizer, prompt_ids: list[int], cfg: GenerationConfig,
                  stats: GenerationStats | None = None) -> str:
    return "".join(stream_text(tokenizer, generate_tokens(model, prompt_ids, cfg, stats), cfg.stop))


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for a raw prompt, or for one user turn through the model's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise QconvError("this tokenizer has no chat template", fix="use --prompt instead of --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
