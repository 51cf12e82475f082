"""A recipe's `quality:` section: the held-out text, the gates per model tier and the regression tolerances."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Gates:
    max_mean_kld: float | None = None
    max_p99_kld: float | None = None
    min_top1: float | None = None  # fraction 0..1
    max_ppl_ratio: float | None = None  # PPL(quantized) / PPL(original)
    min_task_recovery: float | None = None  # task accuracy quantized / original


@dataclass
class GateTier:
    """Gates for one model class. The tier whose min_params the model reaches (largest first) applies, and the
    report names it: a 135M model is judged by small-model gates, never silently by the 27B's."""

    name: str
    min_params: float
    weights: Gates = field(default_factory=Gates)
    weights_kv: Gates = field(default_factory=Gates)


@dataclass
class Regression:
    """Tolerances for `qconv check --against`: how much worse than the recorded report is still a pass."""

    mean_kld_rel: float = 0.10
    p99_kld_rel: float = 0.20
    top1_abs: float = 0.01
    ppl_ratio_abs: float = 0.01


@dataclass
class Quality:
    text: str | None = None  # held-out text (file or HF dataset id) for the build's quality report
    window: int = 2048
    max_tokens: int = 8192
    tiers: list[GateTier] = field(default_factory=list)
    regression: Regression = field(default_factory=Regression)

    def tier_for(self, num_params: int) -> GateTier | None:
        for t in sorted(self.tiers, key=lambda t: -t.min_params):
            if num_params >= t.min_params:
                return t
        return None
