"""Token selection: temperature / top-k / top-p processing, and the two lossless verification
rules of speculative decoding (greedy prefix match; rejection sampling that preserves the target distribution)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters; penalties 0 are off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    frequency_penalty: float = 0.0  # OpenAI's: a generated token's logit loses this per time it was generated
    presence_penalty: float = 0.0  # and this once it was generated at all

    @property
    def penalized(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _as_column(x, n: int, dtype, device) -> torch.Tensor:
    """A per-row parameter (python scalar or tensor[B]) as a [B, 1] tensor, so one batch can mix settings."""
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.reshape(-1, 1).expand(n, 1) if t.numel() == 1 else t.reshape(n, 1)


def probs_from_logits(logits: torch.Tensor, temperature=1.0, top_p=1.0, top_k=0) -> torch.Tensor:
    """Processed next-token distribution for logits[..., V]. Rows with temperature <= 0 become a one-hot on the
    argmax, so greedy rows are just a degenerate case of sampling (and of rejection verification)."""
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).float()
    n, v = x.shape
    temp = _as_column(temperature, n, torch.float32, x.device)
    k = _as_column(top_k, n, torch.long, x.device)
    p = _as_column(top_p, n, torch.float32, x.device)
    greedy = temp <= 0
    x = x / torch.where(greedy, torch.ones_like(temp), temp)
    if bool(((k > 0) & (k < v)).any()) or bool((p < 1).any()):
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        rank = torch.arange(v, device=x.device).expand(n, v)
        drop = (k > 0) & (rank >= k)
        sp = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop |= (sp.cumsum(-1) - sp) >= p
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    onehot = torch.zeros_like(probs).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, probs).reshape(shape)


def penalize(logits: torch.Tensor, generated: list[int], draft: list[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's repetition penalties on logits[k+1, V] (as vLLM applies them: over generated tokens, not the
    prompt). Row i is scored after `generated` + draft[:i], so a verified block gets what plain decoding would."""
    v = logits.shape[-1]
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=v)[:v].float()
    rows = []
    for i in range(logits.shape[0]):
        if i:
            counts[draft[i - 1]] += 1
        rows.append(logits[i].float() - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty)
    return torch.stack(rows)


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """target_logits[k+1, V] scored at the last accepted token and each draft token. Returns (n accepted, next
    token): the longest prefix equal to the target's argmax, then the target's own token (or the bonus)."""
    best = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sampling(
    draft: list[int],
    draft_probs: list[torch.Tensor | None],
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Rejection sampling (Leviathan et al. / Chen et al.): accept draft token x with probability
    min(1, p(x)/q(x)); on the first rejection sample from normalize(max(0, p - q)); after k accepts sample the
    bonus from p. draft_probs[i] is q for draft i, or None for a point-mass draft (q(x) = 1, e.g. prompt lookup).
    target_probs[k+1, V] are the processed target distributions. The output token is distributed exactly as p."""
    uniforms = torch.rand(len(draft), generator=generator, device=target_probs.device) if draft else None
    for i, x in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i]
        qx = 1.0 if q is None else float(q[x])
        if float(uniforms[i]) * qx < float(p[x]):  # u < p/q without dividing by a zero q
            continue
        if q is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        residual = (p - q.to(p.dtype)).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection has probability ~0, fall back to p
            residual = p
        tok = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return i, int(tok)
    return len(draft), int(torch.multinomial(target_probs[len(draft)], 1, generator=generator))
