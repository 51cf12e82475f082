"""KV-cache quantization simulated inside attention, to measure what a KV scheme costs on top of the weights.

The interface a KV scheme implements (qconv.kv provides KVarN and baselines through `get_kv_scheme(name)`):
    scheme.name: str
    scheme.fake_quant(k, v) -> (k, v)
k, v: [batch, kv_heads, tokens, head_dim], the whole sequence written so far (post-RoPE keys, as a cache holds
them); the scheme quantizes and dequantizes them with its own tile semantics and returns tensors of the same shape
and dtype. We register one attention function per scheme with transformers' AttentionInterface (and sdpa's mask
builder under the same name), so every full-attention layer — llama, qwen3, qwen3_5's full-attention layers —
attends over the dequantized values; linear-attention layers hold no KV cache and are untouched.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch



class KVScheme(Protocol):
    name: str

    def fake_quant(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def get_scheme(name: str) -> KVScheme:
    """A KV scheme by name from qconv.kv (bf16, fp8_e4m3, int8/int4 baselines, KIVI, KVarN)."""
    from qconv.kv import get_kv_scheme

    return get_kv_scheme(name)


def _register(scheme: KVScheme) -> str:
    """Register (idempotently) an sdpa attention that sees the scheme's dequantized K/V; returns its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = f"qconv_kvsim_{scheme.name}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = scheme.fake_quant(key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def kv_simulation(model, scheme: KVScheme | None):
    """Within the block, the model's attention layers attend over `scheme`-quantized K/V."""
    if scheme is None:
        yield model
        return
    before = model.config._attn_implementation
    model.set_attn_implementation(_register(scheme))
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
