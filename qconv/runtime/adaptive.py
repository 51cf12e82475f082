"""When to speculate and how far: per-position acceptance estimates (scored against the tokens actually produced,
so they keep learning while speculation is backed off), a cost model of a verify forward of T tokens measured
online, and the block cap that only grows after saturated steps. Speculation pays when the expected tokens per
step outgrow the extra cost of scoring the draft; otherwise the controller drafts nothing (plain decode)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_POS = 16


@dataclass
class HitStats:
    """Drafter hit rate per draft position and source: P(draft i == produced token | drafts < i matched).
    `rate` is a running estimate (mean at first, then an exponential average so it tracks the text);
    `reached`/`hits` are plain counts for reporting."""

    prior: float = 0.5
    prior_weight: float = 2.0
    horizon: float = 32.0  # effective memory of the running estimate, in observations
    rate: dict[tuple[str, int], float] = field(default_factory=dict)
    weight: dict[tuple[str, int], float] = field(default_factory=dict)
    reached: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    hits: list[int] = field(default_factory=lambda: [0] * MAX_POS)

    def estimate(self, source: str, pos: int) -> float:
        return self.rate.get((source, min(pos, MAX_POS - 1)), self.prior)

    def update(self, source: str, pos: int, hit: bool) -> None:
        key = (source, min(pos, MAX_POS - 1))
        w = self.weight.get(key, self.prior_weight) + 1.0
        self.weight[key] = min(w, self.horizon)
        r = self.rate.get(key, self.prior)
        self.rate[key] = r + (float(hit) - r) / self.weight[key]
        self.reached[key[1]] += 1
        self.hits[key[1]] += int(hit)

    def per_position(self) -> list[float | None]:
        return [h / r if r else None for h, r in zip(self.hits, self.reached)]


@dataclass
class _Pending:
    start: int  # sequence length when proposed: tokens[i] predicts seq[start + i]
    tokens: list[int]
    sources: list[str]
    scored: int = 0  # leading positions already scored (all hits)


@dataclass
class ShadowScorer:
    """Scores every proposal against the tokens the target really produced, whether or not it was verified."""

    stats: HitStats
    pending: list[_Pending] = field(default_factory=list)

    def propose(self, start: int, tokens: list[int], sources: list[str]) -> None:
        if tokens:
            self.pending.append(_Pending(start, list(tokens), list(sources)))

    def observe(self, seq: list[int]) -> None:
        keep = []
        for p in self.pending:
            hit = True
            while hit and p.scored < len(p.tokens) and p.start + p.scored < len(seq):
                i = p.scored
                hit = seq[p.start + i] == p.tokens[i]
                self.stats.update(p.sources[i], i, hit)
                p.scored += 1
            if hit and p.scored < len(p.tokens):
                keep.append(p)
        self.pending = keep


@dataclass
class CostModel:
    """Wall time of a forward of T tokens, learned online per T (exponential average). On a CPU it is far from
    linear (T=4 may cost 1.6x a decode step, T=16 only 2.2x), so unmeasured sizes are interpolated between
    measured neighbours, and sizes past the largest measured one are assumed nearly as cheap as it (optimistic,
    so wider blocks get tried and measured; on a GPU they really are that cheap)."""

    prior_slope: float = 0.03
    alpha: float = 0.2
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, T: int, seconds: float) -> None:
        old = self.seconds.get(T)
        self.seconds[T] = seconds if old is None else old + self.alpha * (seconds - old)

    def relative(self, T: int) -> float:
        """Cost of a T-token forward in units of a 1-token forward."""
        base = self.seconds.get(1)
        if base is None or T == 1:
            return 1.0 + self.prior_slope * (T - 1)
        if T in self.seconds:
            return max(self.seconds[T] / base, 1.0)
        lo = max(t for t in self.seconds if t < T)
        hi = min((t for t in self.seconds if t > T), default=None)
        if hi is None:
            return self.relative(lo) + self.prior_slope * (T - lo)
        w = (T - lo) / (hi - lo)
        return (1 - w) * self.relative(lo) + w * self.relative(hi)


@dataclass
class SpecController:
    """Block cap: `base` tokens, doubled (up to `max_block`) after each saturated step, back to `base` after a
    rejection. Within the cap, keep the draft prefix that maximizes expected tokens per unit of step cost; among
    prefixes within `tolerance` of the best, the longest (more tokens per step at a wall-clock cost in the noise)."""

    base: int = 4
    max_block: int = 15
    adaptive: bool = True
    tolerance: float = 0.03
    stats: HitStats = field(default_factory=HitStats)
    cost: CostModel = field(default_factory=CostModel)
    cap: int = 0

    def __post_init__(self):
        self.cap = self.base

    def choose(self, sources: list[str]) -> int:
        """How many of the proposed draft tokens (with these sources) to verify."""
        n = min(len(sources), self.cap)
        if not self.adaptive:
            return n
        rates, expected, survive = [1.0], 1.0, 1.0
        for i in range(n):
            survive *= self.stats.estimate(sources[i], i)
            expected += survive
            rates.append(expected / self.cost.relative(i + 2))
        best = max(rates)
        if best <= 1.0:
            return 0
        return max(k for k, r in enumerate(rates) if r >= best * (1 - self.tolerance))

    def after_step(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.cap = min(self.max_block, max(self.cap * 2, self.base))
        elif drafted:
            self.cap = self.base
