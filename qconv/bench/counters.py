"""Speculation's acceptance from the server's own Prometheus counters, read before and after a run: vLLM's
`vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens(_per_pos)` or qconv's
`qconv_spec_drafts / _draft_tokens / _accepted_tokens`. Tokens per verify step is `vllm bench serve`'s acceptance
length: 1 + accepted / drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

NAMES = {  # our field -> the counter (sample name without _total) on each server
    "drafts": ("vllm:spec_decode_num_drafts", "qconv_spec_drafts"),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens", "qconv_spec_draft_tokens"),
    "accepted": ("vllm:spec_decode_num_accepted_tokens", "qconv_spec_accepted_tokens"),
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    source: str = ""  # "vllm" | "qconv" | "" (the server exports neither)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: dict[int, int] = field(default_factory=dict)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        pos = {p: v - before.per_pos.get(p, 0) for p, v in self.per_pos.items()}
        return SpecCounters(
            self.source,
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            pos,
        )

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verify step (None: nothing was drafted)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    def per_position(self) -> list[float]:
        return [self.per_pos[p] / self.drafts for p in sorted(self.per_pos)] if self.drafts else []


def parse(text: str) -> SpecCounters:
    """The spec-decode counters in a /metrics page (summed over label sets: vLLM labels them per engine)."""
    out = SpecCounters()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            name = s.name.removesuffix("_total")
            if name == PER_POS:
                p = int(s.labels.get("position", 0))
                out.per_pos[p] = out.per_pos.get(p, 0) + int(s.value)
                out.source = "vllm"
                continue
            for key, names in NAMES.items():
                if name in names:
                    setattr(out, key, getattr(out, key) + int(s.value))
                    out.source = "vllm" if name == names[0] else "qconv"
    return out
