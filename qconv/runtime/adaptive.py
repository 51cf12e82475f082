"""When to speculate and how far: per-position acceptance estimates (scored against the tokens actually produced,
so they keep learning while speculation is backed off), their calibration against what verified steps really
accepted, a cost model of a verify forward of T tokens measured online, and the block cap that only grows after
saturated steps. Speculation pays when the expected tokens per step outgrow the extra cost of scoring the draft;
otherwise the controller drafts nothing (plain decode)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

MAX_POS = 16
CALIBRATION_BANDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # predicted accepted drafts of a verified step


@dataclass
class HitStats:
    """Drafter hit rate per draft position and source: P(draft i == produced token | drafts < i matched).
    `rate` is a running estimate (mean at first, then an exponential average so it tracks the text);
    `reached`/`hits` are plain counts for reporting."""

    prior: float = 0.5
    prior_weight: float = 2.0
    horizon: float = 32.0  # effective memory of the running estimate, in observations
    rate: dict[tuple[Hashable, int], float] = field(default_factory=dict)  # (source, position) -> running rate
    weight: dict[tuple[Hashable, int], float] = field(default_factory=dict)
    reached: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    hits: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    # Verified steps, per band of predicted gain (CALIBRATION_BANDS): decayed sums of the accepted drafts predicted
    # (the sum of the verified nodes' estimates) and of those really accepted. The per-kind rates are right on
    # average but not per verified tree, and not alike for small and large trees (SmolLM2, bf16, 3090 artifact,
    # copy: trees predicted to accept 1-2 drafts accepted 1.7x that, those predicted 4+ 0.65x; chat: predicted
    # ~0.5, accepted ~0.25), so a draft's expected gain is scaled by the ratio measured in its band.
    predicted: dict[int, float] = field(default_factory=dict)
    accepted: dict[int, float] = field(default_factory=dict)
    calibration_memory: float = 0.9  # ~10 verified steps of the band
    calibration_evidence: float = 1.0  # pseudo-tokens at ratio 1 (a band without evidence is taken as it comes)

    def estimate(self, source: Hashable, pos: int, prior: float | None = None) -> float:
        return self.rate.get((source, min(pos, MAX_POS - 1)), self.prior if prior is None else prior)

    def update(self, source: Hashable, pos: int, hit: bool, count: bool = True, prior: float | None = None) -> None:
        """Learn from one scored draft; `count=False` leaves the reported per-position counts alone (token trees
        count one event per depth, not one per sibling: see `count`). `prior`: where a new key's estimate starts
        (the same one `estimate` falls back to for it)."""
        key = (source, min(pos, MAX_POS - 1))
        w = self.weight.get(key, self.prior_weight) + 1.0
        self.weight[key] = min(w, self.horizon)
        r = self.rate.get(key, self.prior if prior is None else prior)
        self.rate[key] = r + (float(hit) - r) / self.weight[key]
        if count:
            self.count(pos, hit)

    def count(self, pos: int, hit: bool) -> None:
        self.reached[min(pos, MAX_POS - 1)] += 1
        self.hits[min(pos, MAX_POS - 1)] += int(hit)

    def calibrate(self, predicted: float, accepted: int) -> None:
        """One verified step: `predicted` accepted drafts (uncalibrated estimate), `accepted` really."""
        b, m = _band(predicted), self.calibration_memory
        self.predicted[b] = self.predicted.get(b, 0.0) * m + predicted
        self.accepted[b] = self.accepted.get(b, 0.0) * m + accepted

    def calibration(self, predicted: float) -> float:
        """Accepted / predicted drafts over the recent verified steps whose prediction fell in the band of
        `predicted` (1 before any evidence)."""
        b, k = _band(predicted), self.calibration_evidence
        return min(max((self.accepted.get(b, 0.0) + k) / (self.predicted.get(b, 0.0) + k), 0.2), 2.0)

    def per_position(self) -> list[float | None]:
        return [h / r if r else None for h, r in zip(self.hits, self.reached)]


def _band(predicted: float) -> int:
    return bisect.bisect(CALIBRATION_BANDS, predicted)


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
    """Wall time of a forward of T tokens, learned online. A decode step (T=1) is an exponential average of its
    own; wider forwards follow a power law c * T^k fitted (least squares in log-log, recent observations weighted
    more) to every wider forward seen. On a CPU the cost is far from linear (T=4 ~1.6x a decode step, T=16 ~2.5x,
    T=64 ~5x) and single measurements on a shared machine are noisy (2x swings), so one smooth curve fitted to all
    sizes ranks token trees of different sizes far better than per-size averages. Before two sizes are seen,
    sizes past the largest measured one are assumed nearly as cheap as it (optimistic, so wider blocks get tried
    and measured; on a GPU they really are that cheap)."""

    prior_slope: float = 0.03
    alpha: float = 0.2
    memory: float = 0.97  # weight kept by older observations at each new one
    seconds: dict[int, float] = field(default_factory=dict)
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weighted n, x, y, xx, xy (x = log T, y = log s)

    def observe(self, T: int, seconds: float) -> None:
        old = self.seconds.get(T)
        self.seconds[T] = seconds if old is None else old + self.alpha * (seconds - old)
        if T > 1 and seconds > 0:
            x, y = math.log(T), math.log(seconds)
            self.sums = [a * self.memory + b for a, b in zip(self.sums, (1.0, x, y, x * x, x * y))]

    def _fit(self) -> tuple[float, float] | None:
        n, sx, sy, sxx, sxy = self.sums
        var = n * sxx - sx * sx
        if sum(1 for t in self.seconds if t > 1) < 2 or var <= 1e-9 * max(n * sxx, 1e-12):
            return None
        k = min(max((n * sxy - sx * sy) / var, 0.0), 1.0)
        return (sy - k * sx) / n, k

    def relative(self, T: int) -> float:
        """Cost of a T-token forward in units of a 1-token forward."""
        base = self.seconds.get(1)
        if base is None or T == 1:
            return 1.0 + self.prior_slope * (T - 1)
        fit = self._fit()
        if fit is not None:
            return max(math.exp(fit[0] + fit[1] * math.log(T)) / base, 1.0)
        wider = [t for t in self.seconds if t > 1]
        if not wider:
            return 1.0 + self.prior_slope * (T - 1)
        lo = max(wider)  # one wider size seen: interpolate from a decode step, extrapolate optimistically
        rel = max(self.seconds[lo] / base, 1.0)
        return 1.0 + (rel - 1.0) * (T - 1) / (lo - 1) if T < lo else rel + self.prior_slope * (T - lo)


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
    predicted: float = 0.0  # uncalibrated expected accepted drafts of the last choice (for HitStats.calibrate)

    def __post_init__(self):
        self.cap = self.base

    def choose(self, sources: list[str]) -> int:
        """How many of the proposed draft tokens (with these sources) to verify."""
        n = min(len(sources), self.cap)
        if not self.adaptive:
            return n
        probs, survive = [], 1.0
        for i in range(n):
            survive *= self.stats.estimate(sources[i], i)
            probs.append(survive)
        return self._best_prefix(probs, range(n + 1))

    def choose_tree(self, probs: list[float], sizes: tuple[int, ...], rows: int = 0) -> int:
        """How many nodes of a token tree to verify, given each node's estimated probability of acceptance
        (best first, so every prefix is a tree): only forward sizes T = rows + n + 1 in `sizes` (fewer distinct
        sizes for the cost model to measure) or the whole tree. `rows`: other rows the forward computes anyway."""
        if not self.adaptive:
            return len(probs)
        allowed = [n for n in range(len(probs) + 1) if rows + n + 1 in sizes or n in (0, len(probs))]
        return self._best_prefix(probs, allowed, rows)

    def _best_prefix(self, probs: list[float], allowed, rows: int = 0) -> int:
        """The n maximizing expected tokens per unit of step cost, (1 + c * sum(probs[:n])) / cost(rows + n + 1)
        with c the stats' calibration in the band of that sum; among the n within `tolerance` of the best, the
        largest. 0 (no draft) when no draft pays. `allowed` holds 0."""
        sums, cum = [0.0], 0.0
        for p in probs:
            cum += p
            sums.append(cum)
        cal = self.stats.calibration
        rates = {n: (1.0 + cal(sums[n]) * sums[n]) / self.cost.relative(rows + n + 1) for n in allowed}
        best, base = max(rates.values()), rates[0]  # base: no draft (a plain decode step when rows == 0)
        n = 0 if best <= base else max(n for n, r in rates.items() if r >= max(best * (1 - self.tolerance), base))
        self.predicted = sums[n]
        return n

    def verified(self, accepted: int) -> None:
        """The draft of the last choice was verified and `accepted` of its tokens kept: calibrate on it."""
        if self.adaptive:
            self.stats.calibrate(self.predicted, accepted)

    def after_step(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.verified(accepted)
        if drafted and accepted == drafted:
            self.cap = min(self.max_block, max(self.cap * 2, self.base))
        elif drafted:
            self.cap = self.base
