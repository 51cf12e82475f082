"""EngineConfig: the handful of numbers our model code needs, made from a ModelSpec through transformers' own config
classes (so defaults, rope parameters and family quirks match the reference implementation). The config class is
built from the spec's dict: config.json is not read again."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from qconv.errors import QconvError
from qconv.models.family import LinearState
from qconv.models.spec import ModelSpec

ATTENTION_TYPES = ("full_attention", "sliding_attention")  # layer types that keep K/V


@dataclass
class EngineConfig:
    family: str  # the Family's name ("llama", "qwen3_5", ...)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position_embeddings: int
    eos_token_ids: list[int]
    tie_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (qwen2): the loader sets it from the checkpoint's keys
    o_bias: bool = False
    qk_norm: bool = False  # qwen3 / qwen3_5: RMSNorm over head_dim of q and k
    attn_output_gate: bool = False  # qwen3_5: q_proj also yields a sigmoid output gate
    norm_offset: float = 0.0  # qwen3_5 norms scale by (1 + w)
    rotary_dim: int = 0  # partial RoPE: only the first rotary_dim channels rotate
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "linear_attention"
    # Gated DeltaNet (qwen3_5)
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    conv_kernel: int = 0
    linear_state: LinearState | None = None  # one linear layer's per-sequence state shapes (the Family's)
    has_mtp: bool = False
    weight_prefix: str = "model."  # where decoder weights live in the checkpoint
    inv_freq: torch.Tensor | None = field(default=None, repr=False)
    rope_scaling: float = 1.0  # attention_scaling of the rope variant (yarn etc.)
    attn_scale: float | None = None  # softmax scale when not 1/sqrt(head_dim) (a Family's engine_options)
    # sliding-window layers (layer type "sliding_attention"): their window and their own rope where the config
    # keeps one per layer type (inverse frequencies, attention_scaling)
    sliding_window: int = 0
    local_inv_freq: torch.Tensor | None = field(default=None, repr=False)
    local_rope_scaling: float = 1.0
    logit_softcap: float | None = None  # final logits: cap * tanh(logits / cap) (a Family's engine_options)

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def kv_layers(self) -> list[int]:
        """Layers that keep K/V in the cache (full and sliding-window attention), in order."""
        return [i for i, t in enumerate(self.layer_types) if t in ATTENTION_TYPES]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


def _rope(hf, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float, int]:
    """Inverse frequencies via transformers' rope registry (llama3, yarn, ... included); default computed here.
    `layer_type`: the rope of that layer type, where the config keeps one per type (`rope_parameters` keyed by
    layer type)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    rtype = params.get("rope_type", "default")
    partial = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0)
    dim = int(head_dim * partial)
    if rtype == "default":
        theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv.float(), 1.0, dim
    if rtype not in ROPE_INIT_FUNCTIONS:
        raise QconvError(f"unsupported rope_type {rtype!r}", fix=f"one of default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv, scale = ROPE_INIT_FUNCTIONS[rtype](hf, None, **({"layer_type": layer_type} if layer_type else {}))
    return inv.float(), float(scale), dim


def _eos_ids(spec: ModelSpec, *configs) -> list[int]:
    """eos ids of the model configs and generation_config.json, in order, each once."""
    from transformers import GenerationConfig

    if (spec.folder / "generation_config.json").is_file():
        configs += (GenerationConfig.from_pretrained(spec.folder),)
    ids: list[int] = []
    for c in configs:
        eos = getattr(c, "eos_token_id", None)
        for e in [eos] if isinstance(eos, int) else eos or []:
            if int(e) not in ids:
                ids.append(int(e))
    return ids


def hf_config(spec: ModelSpec):
    """transformers' config object of the model, from the spec's dict (no second read of config.json)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[spec.model_type].from_dict(copy.deepcopy(spec.config))


def engine_config(spec: ModelSpec, *, has_mtp: bool = False) -> EngineConfig:
    """The EngineConfig of a model; its family's options (norm offset, q/k norm, output gate, linear-layer state
    and the `engine_options` it reads from transformers' config itself) come from the Family."""
    top = hf_config(spec)
    hf = top.get_text_config()
    fam = spec.family
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    n = hf.num_hidden_layers
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * n)
    per_type = isinstance((getattr(hf, "rope_parameters", None) or {}).get("full_attention"), dict)
    inv_freq, rscale, rdim = _rope(hf, head_dim, "full_attention" if per_type else None)
    cfg = EngineConfig(
        family=fam.name,
        model_type=spec.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=n,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        rms_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        eos_token_ids=_eos_ids(spec, top, hf),
        tie_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        qk_norm=fam.qk_norm,
        attn_output_gate=fam.attn_output_gate,
        norm_offset=fam.norm_offset,
        rotary_dim=rdim,
        layer_types=types,
        has_mtp=has_mtp,
        weight_prefix=spec.weight_prefix,
        inv_freq=inv_freq,
        rope_scaling=rscale,
    )
    if spec.linear_layers:
        cfg.linear_num_k_heads, cfg.linear_num_v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
        cfg.linear_k_head_dim, cfg.linear_v_head_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
        cfg.conv_kernel = hf.linear_conv_kernel_dim
    if "sliding_attention" in types:
        cfg.sliding_window = int(hf.sliding_window)
        cfg.local_inv_freq, cfg.local_rope_scaling, _ = _rope(hf, head_dim, "sliding_attention" if per_type else None)
    cfg.linear_state = spec.linear_state
    return replace(cfg, **fam.engine_options(hf, spec))  # a field EngineConfig lacks is a TypeError here
