"""Normalized Sylvester Hadamard matrix: an orthonormal rotation that spreads outlier channels over all channels
before low-bit rounding. H/sqrt(D) is symmetric and its own inverse, so the same matrix rotates and un-rotates."""

from __future__ import annotations

import torch

from qconv.errors import QconvError
from qconv_vllm.kvarn_codec import sylvester


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """H_d / sqrt(d) for d a power of two (the plugin's matrix: KV records written by either side match)."""
    if d <= 0 or d & (d - 1):
        raise QconvError(
            f"Hadamard rotation needs a power-of-two head_dim, got {d}",
            fix="use a KV scheme without rotation (kivi_*, int4_g32, int8_token, fp8_e4m3) for this model",
        )
    return sylvester(d).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H/sqrt(D) over the last dim (also the inverse rotation, since H/sqrt(D) is symmetric and involutory)."""
    return x @ hadamard(x.shape[-1], x.dtype, x.device)
