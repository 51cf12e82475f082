"""KV-cache quantization simulated inside attention, to measure what a KV scheme costs on top of the weights.

A scheme comes from qconv.kv's registry (`get_kv_scheme(name)`), the same codec the engine's packed KV store runs.
We register one attention function per (scheme, form) with transformers' AttentionInterface (and sdpa's mask builder
under the same name), so every full-attention layer — llama, qwen3, qwen3_5's full-attention layers — attends over
the dequantized values; linear-attention layers hold no KV cache and are untouched. Two forms:
- "decode" (default): what the engine's decode steps read: a token is quantized once its tile has closed, the sink
  and the tile being filled stay exact (`KVScheme.decode_time`);
- "prefill": every full tile quantized for every query (the pessimistic form: a query also sees its own tile
  quantized, as a prompt prefilled in one forward does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from qconv.errors import QconvError
from qconv.kv import get_kv_scheme
from qconv.kv.base import KVScheme

KV_FORMS = ("decode", "prefill")
# The decode form's keys are the sequence twice (quantized, then exact) under a mask that no fused kernel skips:
# one masked call over all 2T keys. Query chunks over only the columns they attend to (causal; an exact copy only
# within its own tile and the sink) do about a quarter of that work.
QUERY_CHUNK = 256


@dataclass(frozen=True)
class SimulatedKV:
    """A KV scheme as `qconv eval` simulates it: which scheme, in which form."""

    scheme: KVScheme
    form: str = "decode"

    @property
    def name(self) -> str:
        return self.scheme.name


def get_scheme(name: str, form: str = "decode") -> SimulatedKV:
    """A KV scheme by name from qconv.kv (bf16, fp8_e4m3, int8/int4 baselines, KIVI, KVarN)."""
    if form not in KV_FORMS:
        raise QconvError(f"unknown KV simulation form {form!r}", where="--kv-form", fix=f"one of {', '.join(KV_FORMS)}")
    return SimulatedKV(get_kv_scheme(name), form)


def _register(sim: SimulatedKV) -> str:
    """Register (idempotently) an sdpa attention that sees the scheme's dequantized K/V; returns its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = f"qconv_kvsim_{sim.scheme.name}_{sim.form}"
    scheme = sim.scheme

    def attention(module, query, key, value, attention_mask, **kwargs):
        if sim.form == "prefill":
            key, value = scheme.fake_quant(key, value)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        key, value, allowed = scheme.decode_time(key, value)
        allowed = allowed[-query.shape[2] :][None, None]
        if attention_mask is not None:
            base = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            allowed = allowed & torch.cat([base, base], -1)
        kwargs.pop("is_causal", None)
        outs = []
        for a in range(0, query.shape[2], QUERY_CHUNK):  # a chunk's queries, over the columns they attend to
            rows = allowed[..., a : a + QUERY_CHUNK, :]
            cols = rows.flatten(0, -2).any(0).nonzero().squeeze(1)
            q, k, v = query[:, :, a : a + QUERY_CHUNK], key[:, :, cols], value[:, :, cols]
            outs.append(sdpa_attention_forward(module, q, k, v, rows[..., cols], is_causal=False, **kwargs)[0])
        return torch.cat(outs, 1), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def kv_simulation(model, scheme: SimulatedKV | None):
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
