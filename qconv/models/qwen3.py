"""Qwen3 dense: the llama blocks with an RMSNorm over each head of q and k (qk-norm)."""

from __future__ import annotations

from dataclasses import replace

from qconv.models.llama import FAMILY as LLAMA

# vLLM's Qwen3Model (a Qwen2Model) builds embed_tokens with its quantization prefix
FAMILY = replace(LLAMA, name="qwen3", model_types=("qwen3",), qk_norm=True, vllm_quantized_embed=("qwen3",))
