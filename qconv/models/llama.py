"""The llama family (llama, qwen2 with its q/k/v biases, mistral): attention + SwiGLU MLP blocks, as
qconv.models.blocks builds them. Its role patterns and fused groups are the ones other families start from."""

from __future__ import annotations

from qconv.models.blocks import Transformer
from qconv.models.family import Family, Fused

# Roles of an attention + MLP decoder (tensor names without `.weight`)
ATTENTION_ROLES = (
    ("embed", r"(^|\.)embed_tokens$"),
    ("lm_head", r"(^|\.)lm_head$"),
    ("attn_qkv", r"\.self_attn\.[qkv]_proj$"),
    ("attn_o", r"\.self_attn\.o_proj$"),
    ("mlp_gate_up", r"\.mlp\.(gate|up)_proj$"),
    ("mlp_down", r"\.mlp\.down_proj$"),
)
# checkpoint q/k/v and gate/up -> our engine's and vLLM's fused modules (the same names in both)
LLAMA_FUSED = (
    Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    Fused("gate_up_proj", ("gate_proj", "up_proj"), "gate_up_proj"),
)
# a role's linears as vLLM names them (fused where vLLM fuses), for the plugin's W4A8 restriction
LLAMA_VLLM_ROLES = {
    "attn_qkv": r"\.self_attn\.qkv_proj$",
    "attn_o": r"\.self_attn\.o_proj$",
    "mlp_gate_up": r"\.mlp\.gate_up_proj$",
    "mlp_down": r"\.mlp\.down_proj$",
}

FAMILY = Family(
    name="llama",
    model_types=("llama", "qwen2", "mistral"),
    role_patterns=ATTENTION_ROLES,
    fused_roles=frozenset({"attn_qkv", "mlp_gate_up"}),
    fused=LLAMA_FUSED,
    transformer=Transformer,
    vllm_role_modules=LLAMA_VLLM_ROLES,
    vllm_quantized_embed=("qwen2",),  # vLLM's Qwen2Model; its LlamaModel and MistralModel do not
)
