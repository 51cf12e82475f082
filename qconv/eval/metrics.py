"""Per-token KLD(original || quantized), top-1 agreement and PPL — the statistics llama.cpp's
`perplexity --kl-divergence` prints, computed the same way (mean ± standard error over tokens, quantiles).

With a top-k reference the tail is unseen. `kld` is then the log-sum estimate over the k tokens plus the tail
taken as one bucket, a proven lower bound of the exact value (log-sum inequality); `kld_hi` is the largest value
the exact KLD can take given what is stored (each tail probability <= the k-th largest, tail mass known, exact
entropy known): the quantized tail log-probs are filled from the smallest up. So kld <= exact <= kld_hi per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qconv.eval.record import MetricSummary
from qconv.eval.reference import RefWindow


def kld_full(ref_logp16: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(ref_logp16.float(), dim=-1)  # renormalize after fp16 storage
    return (logp.exp() * (logp - logq)).sum(-1)


def _tail_cross_extremes(logq: torch.Tensor, idx: torch.Tensor, tail: torch.Tensor, cap: torch.Tensor):
    """Min and max of -sum_tail p_i log q_i over tail distributions with sum p_i = tail, 0 <= p_i <= cap."""
    nlq = (-logq).scatter(-1, idx, float("inf"))  # the top-k are not in the tail
    lo_sorted = nlq.sort(-1).values  # cheapest first (largest q)
    n_full = torch.clamp(torch.floor(tail / cap), max=lo_sorted.shape[-1] - idx.shape[-1] - 1).long()
    rest = tail - n_full.double() * cap

    def fill(sorted_nlq):
        finite = torch.where(torch.isinf(sorted_nlq), torch.zeros_like(sorted_nlq), sorted_nlq)
        csum = torch.cat([torch.zeros_like(finite[:, :1]), finite.cumsum(-1)], -1)
        return cap * csum.gather(-1, n_full[:, None])[:, 0] + rest * finite.gather(-1, n_full[:, None])[:, 0]

    ntail = lo_sorted.shape[-1] - idx.shape[-1]
    hi_sorted = lo_sorted[:, :ntail].flip(-1)  # dearest first (smallest q)
    return fill(lo_sorted), fill(hi_sorted)


def kld_topk(ref: RefWindow, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(estimate = lower bound, lower, upper) per token from a top-k reference; float64."""
    logq = logq.double()
    lp = ref.topk_logp.double()
    p = lp.exp()
    lq_s = logq.gather(-1, ref.topk_idx)
    head_mass = p.sum(-1).clamp(max=1.0)
    tail = (1.0 - head_mass).clamp(min=0.0)
    log_tail = torch.log(tail.clamp(min=1e-300))
    log_qtail = torch.logsumexp(logq.scatter(-1, ref.topk_idx, float("-inf")), dim=-1)
    head = (p * (lp - lq_s)).sum(-1)
    est = head + torch.where(tail > 0, tail * (log_tail - log_qtail), torch.zeros_like(tail))
    cap = p[:, -1].clamp(min=1e-300)
    cross_lo, cross_hi = _tail_cross_extremes(logq, ref.topk_idx, tail, cap)
    base = -ref.entropy.double() - (p * lq_s).sum(-1)  # KLD = -H - sum_S p log q - sum_tail p log q
    return est, torch.maximum(est, base + cross_lo), torch.maximum(est, base + cross_hi)


@dataclass
class TokenStats:
    """Per-token values gathered window by window (numpy, float64)."""

    kld: list[np.ndarray] = field(default_factory=list)
    kld_hi: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)
    nll_base: list[np.ndarray] = field(default_factory=list)
    nll_q: list[np.ndarray] = field(default_factory=list)

    def add(self, ref: RefWindow, logits_q: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> None:
        """One window; rows go `chunk` at a time so a large vocabulary never needs [n, V] float64 at once."""
        for a in range(0, len(targets), chunk):
            self._add(ref.rows(a, a + chunk), logits_q[a : a + chunk], targets[a : a + chunk])

    def _add(self, ref: RefWindow, logits_q: torch.Tensor, targets: torch.Tensor) -> None:
        logq = torch.log_softmax(logits_q.float(), dim=-1)
        if ref.logp is not None:
            kld = kld_full(ref.logp, logq).double()
            hi = kld
        else:
            kld, _, hi = kld_topk(ref, logq)
        self.kld.append(kld.numpy())
        self.kld_hi.append(hi.numpy())
        self.same_top.append((ref.top1() == logq.argmax(-1)).numpy().astype(np.float64))
        self.nll_base.append(-ref.target_logp.double().numpy())
        self.nll_q.append(-logq.gather(-1, targets[:, None])[:, 0].double().numpy())

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) for k, v in vars(self).items()}


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def summarize(stats: TokenStats) -> MetricSummary:
    a = stats.arrays()
    kld, n = a["kld"], len(a["kld"])
    kmean, kse = _mean_se(kld)
    top1, top1_se = _mean_se(a["same_top"])
    lnr, lnr_se = _mean_se(a["nll_q"] - a["nll_base"])
    nb, nb_se = _mean_se(a["nll_base"])
    nq, nq_se = _mean_se(a["nll_q"])
    dp = np.exp(-a["nll_q"]) - np.exp(-a["nll_base"])
    dp_mean, dp_se = _mean_se(dp)
    q = np.quantile(kld, [0.5, 0.9, 0.99, 0.999])
    return MetricSummary(
        tokens=n,
        kld_mean=kmean,
        kld_se=kse,
        kld_median=float(q[0]),
        kld_p90=float(q[1]),
        kld_p99=float(q[2]),
        kld_p999=float(q[3]),
        kld_max=float(kld.max()),
        kld_min=float(kld.min()),
        # exact mean KLD lies in [kld_mean, kld_mean + kld_bound] (0 for a full reference)
        kld_bound=float((a["kld_hi"] - kld).mean()),
        top1=top1,
        top1_se=top1_se,
        ppl_base=float(np.exp(nb)),
        ppl_base_se=float(np.exp(nb) * nb_se),
        ppl_q=float(np.exp(nq)),
        ppl_q_se=float(np.exp(nq) * nq_se),
        ln_ppl_ratio=lnr,
        ln_ppl_ratio_se=lnr_se,
        ppl_ratio=float(np.exp(lnr)),
        ppl_ratio_se=float(np.exp(lnr) * lnr_se),
        cor_ln_ppl=float(np.corrcoef(a["nll_q"], a["nll_base"])[0, 1]),
        dp_mean=dp_mean,
        dp_se=dp_se,
        dp_rms=float(np.sqrt((dp**2).mean())),
    )


def format_llamacpp(s: MetricSummary) -> str:
    """The summary laid out like llama.cpp's `--kl-divergence` printout, so numbers compare line by line."""
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s.ppl_q:10.6f} ± {s.ppl_q_se:10.6f}",
        f"Mean PPL(base)                : {s.ppl_base:10.6f} ± {s.ppl_base_se:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.cor_ln_ppl:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio:10.6f} ± {s.ln_ppl_ratio_se:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio:10.6f} ± {s.ppl_ratio_se:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_se:10.6f}"
        + (f"   (exact mean within +{s.kld_bound:.6f}, top-k reference)" if s.kld_bound > 0 else ""),
        f"Maximum KLD: {s.kld_max:10.6f}",
        f"99.9%   KLD: {s.kld_p999:10.6f}",
        f"99.0%   KLD: {s.kld_p99:10.6f}",
        f"90.0%   KLD: {s.kld_p90:10.6f}",
        f"Median  KLD: {s.kld_median:10.6f}",
        f"Minimum KLD: {s.kld_min:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s.dp_mean:6.3f} ± {100 * s.dp_se:5.3f} %",
        f"RMS Δp    : {100 * s.dp_rms:6.3f} %",
        f"Same top p: {100 * s.top1:6.3f} ± {100 * s.top1_se:5.3f} %",
        f"({s.tokens} tokens)",
    ]
    return "\n".join(lines)
