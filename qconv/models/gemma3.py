"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text) on the shared blocks: every norm scales by (1 + w) (folded at load), attention
and MLP outputs are normed again before the residual (post-attention and pre/post feed-forward norms), the MLP
gates with tanh-approximated GELU, embeddings are scaled by sqrt(hidden), and sliding-window layers attend to the
last `sliding_window` positions with their own rope base. The cache keeps every position for every attention layer;
the window is a mask."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from qconv.errors import QconvError
from qconv.models.blocks import MLP, Attention, RMSNorm, Step, Transformer, positions, rope_tables
from qconv.models.config import EngineConfig
from qconv.models.family import interleaved_layer_types
from qconv.models.llama import FAMILY as LLAMA


class GeluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Block(nn.Module):
    """Sandwich norms: x + post_norm(f(pre_norm(x))) for attention and for the MLP."""

    def __init__(self, cfg: EngineConfig, mixer: nn.Module):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.mixer = mixer
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = GeluMLP(h, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, st: Step) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.mixer(self.input_layernorm(x), st))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def sliding_step(cfg: EngineConfig, st: Step) -> Step:
    """The Step of a sliding-window layer: its own rope tables, and a mask that also hides keys older than the
    window (a query at p sees p - window + 1 .. p, as transformers and vLLM count it)."""
    device = st.cos.device
    pos = positions(st.starts, st.T, device)
    cos, sin = rope_tables(pos, cfg.local_inv_freq, cfg.local_rope_scaling, st.cos.dtype)
    mask = st.mask
    if mask is not None or st.length > cfg.sliding_window:
        keys = torch.arange(st.length, device=device)
        q = pos[..., None]
        mask = ((keys[None, None, :] <= q) & (keys[None, None, :] > q - cfg.sliding_window))[:, None]
    return replace(st, cos=cos, sin=sin, mask=mask)


class Gemma3Transformer(Transformer):
    def make_block(self, cfg: EngineConfig, i: int) -> nn.Module:
        return Gemma3Block(cfg, Attention(cfg, cfg.kv_layers.index(i)))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # rounded to the model dtype, as HF

    def layer_steps(self, st: Step) -> list[Step]:
        local = sliding_step(self.config, st)
        return [local if t == "sliding_attention" else st for t in self.config.layer_types]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = super().logits(h)
        cap = self.config.logit_softcap
        return out if not cap else torch.tanh(out / cap) * cap


def engine_options(hf, spec) -> dict:
    """Gemma's softmax scale (`query_pre_attn_scalar` ** -0.5, not head_dim's) and final logit soft-cap; its
    attention-logit soft-cap is not in our engine's attention."""
    if getattr(hf, "attn_logit_softcapping", None):
        raise QconvError(
            "attention logit soft-capping is not implemented by the bundled engine",
            where=str(spec.folder / "config.json"),
            fix="serve this model with --backend vllm",
        )
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    return {
        "attn_scale": float(scalar) ** -0.5 if scalar else None,
        "logit_softcap": getattr(hf, "final_logit_softcapping", None),
    }


def restore_buffers(module) -> bool:
    """transformers' scaled embedding keeps sqrt(hidden) in a buffer it does not store: on a meta-device model
    (streamed build) it is put back from the float the module also keeps."""
    if not hasattr(module, "scalar_embed_scale"):
        return False
    module.register_buffer("embed_scale", torch.tensor(module.scalar_embed_scale), persistent=False)
    return True


# Gemma 3's checkpoint names are the llama family's (roles, fused q/k/v and gate/up, vLLM module names); every norm
# (the four per block, q/k and the final one) is a (1 + w) norm the default offset_norms pattern matches. vLLM's
# Gemma3Model builds embed_tokens with its quantization prefix.
FAMILY = replace(
    LLAMA,
    name="gemma3",
    model_types=("gemma3_text",),
    transformer=Gemma3Transformer,
    qk_norm=True,
    norm_offset=1.0,
    engine_options=engine_options,
    # configs on the Hub without `layer_types`: every sliding_window_pattern-th layer (default 6th) is global
    layer_types=partial(
        interleaved_layer_types, every_key="sliding_window_pattern", every=6, other="sliding_attention"
    ),
    restore_buffers=restore_buffers,
    vllm_quantized_embed=("gemma3_text",),
)
