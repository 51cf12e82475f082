"""Module roles per architecture family: the names a recipe speaks in, mapped onto each checkpoint's tensors."""

from __future__ import annotations

import re

from qconv.errors import QconvError

# model_type -> family. One recipe serves every type of a family.
FAMILIES = {
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mistral": "llama",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "gemma3_text": "gemma3",
}

# Checked in order; the first match wins (MTP and vision first: their inner layers look like the trunk's).
_ROLE_PATTERNS = [
    ("mtp", r"^mtp\."),
    ("vision", r"(^|\.)(visual|vision_tower|vision_model)\."),
    ("embed", r"(^|\.)embed_tokens$"),
    ("lm_head", r"(^|\.)lm_head$"),
    ("attn_qkv", r"\.self_attn\.[qkv]_proj$"),
    ("attn_o", r"\.self_attn\.o_proj$"),
    ("mlp_gate_up", r"\.mlp\.(gate|up)_proj$"),
    ("mlp_down", r"\.mlp\.down_proj$"),
    ("gdn_qkvz", r"\.linear_attn\.in_proj_(qkv|z)$"),
    ("gdn_ab", r"\.linear_attn\.in_proj_[ab]$"),
    ("gdn_out", r"\.linear_attn\.out_proj$"),
]
_COMPILED = [(r, re.compile(p)) for r, p in _ROLE_PATTERNS]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# Roles whose members vLLM fuses into one layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj, in_proj_qkv/z).
FUSED = {"attn_qkv", "mlp_gate_up", "gdn_qkvz", "gdn_ab"}


def family_of(config: dict) -> str:
    mt = config.get("model_type", "")
    if mt not in FAMILIES:
        archs = config.get("architectures") or []
        raise QconvError(
            f"unsupported architecture: model_type {mt!r} {archs}",
            where="config.json",
            fix=f"qconv supports model types {', '.join(sorted(FAMILIES))}; open an issue to add yours",
        )
    return FAMILIES[mt]


def text_config(config: dict) -> dict:
    """The language-model part of a config (qwen3_5 nests it under text_config)."""
    return config.get("text_config", config)


def role_of(module: str) -> str | None:
    """Role of a module name (tensor name without `.weight`), or None for norms, convs and other leftovers."""
    for role, pat in _COMPILED:
        if pat.search(module):
            return role
    return None


def unit_of(module: str, role: str) -> str:
    """The quantization unit a module belongs to: fused groups share one (layer, role) unit."""
    prefix = "mtp." if module.startswith("mtp.") else ""
    m = _LAYER.search(module)
    if role in FUSED and m:
        return f"{prefix}layers.{m.group(1)}.{role}"
    return module
