"""Qwen3 dense: the llama blocks with an RMSNorm over each head of q and k (qk-norm)."""

from __future__ import annotations

from dataclasses import replace

from qconv.models.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, name="qwen3", model_types=("qwen3",), qk_norm=True)
