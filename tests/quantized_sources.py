"""Tiny already-quantized checkpoints made by the real library (auto-round 0.15: its own format, AutoGPTQ and
AutoAWQ exports, on the CPU, round-to-nearest so no calibration run is needed), plus the format's reference
dequantization read from the same library's code. Run as `python -m tests.quantized_sources SRC ROOT FAMILY NAME...`
(tests call it in a subprocess: auto-round sets process-wide state): ROOT/FAMILY-NAME for each NAME of SOURCES."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

GROUP = 32
# name -> (auto-round export format, symmetric)
SOURCES = {
    "gptq-sym": ("auto_gptq", True),
    "gptq-asym": ("auto_gptq", False),
    "auto-round-sym": ("auto_round", True),
    "auto-round-asym": ("auto_round", False),
    "awq-asym": ("auto_awq", False),
}


def quantize(src: Path, out: Path, fmt: str, sym: bool, group_size: int = GROUP) -> Path:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    from tests.tiny import CORPUS

    ar = AutoRound(
        model,
        tok,
        bits=4,
        group_size=group_size,
        sym=sym,
        iters=0,
        disable_opt_rtn=True,
        nsamples=2,
        seqlen=32,
        dataset=[CORPUS] * 4,
        device_map="cpu",
    )
    ar.quantize_and_save(str(out), format=fmt)
    (saved,) = [p.parent for p in Path(out).rglob("config.json")]
    return saved


def reference_dense(get, mod: str, layout: str, zero_offset: int, bits: int, group: int) -> torch.Tensor:
    """w [N, K] as the format's own reader computes it: the weight auto-round's QuantLinear (AutoGPTQ v1 zeros: its
    `_zp` variant) multiplies by (its matmul intercepted, so the signs of zeros survive), or its AWQ
    `dequantize_gemm`."""
    from unittest import mock

    qweight, qzeros, scales = get(f"{mod}.qweight"), get(f"{mod}.qzeros"), get(f"{mod}.scales")
    if layout == "awq":
        from auto_round.export.export_to_awq.utils import dequantize_gemm

        return dequantize_gemm(qweight, qzeros, scales, bits, group).t()
    if zero_offset:
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    else:
        from auto_round_extension.torch.qlinear_torch import QuantLinear
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    g_idx = get(f"{mod}.g_idx")
    # its g_idx branch slices scales by input width (wrong when out != in features): use the plain group path,
    # which is the same map whenever g_idx is the plain group map, as asserted here
    assert g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group), mod
    ql = QuantLinear(bits, group, k, n, False)
    ql.qweight, ql.qzeros, ql.scales = qweight, qzeros, scales
    with torch.no_grad(), mock.patch("torch.matmul", lambda x, w: w):
        return ql(torch.zeros(k, k, dtype=scales.dtype)).t()


if __name__ == "__main__":
    src, root, family = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    for name in sys.argv[4:]:
        print(quantize(src, root / f"{family}-{name}", *SOURCES[name]))
