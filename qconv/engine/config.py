"""EngineConfig: the handful of numbers our model code needs, read once from an HF config through transformers'
own config classes (so defaults, rope parameters and family quirks match the reference implementation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qconv.errors import QconvError
from qconv.modelfiles import check_weight_files, read_model_config

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")
QWEN35_FAMILY = ("qwen3_5", "qwen3_5_text")
GEMMA3_FAMILY = ("gemma3_text",)
ATTENTION_TYPES = ("full_attention", "sliding_attention")  # layer types that keep K/V


@dataclass
class EngineConfig:
    family: str  # "llama" (llama/qwen2/qwen3), "qwen3_5" or "gemma3"
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
    attention_bias: bool = False  # qwen2: q/k/v biases (set from the checkpoint's keys)
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
    has_mtp: bool = False
    weight_prefix: str = "model."  # where decoder weights live in the checkpoint
    inv_freq: torch.Tensor | None = field(default=None, repr=False)
    rope_scaling: float = 1.0  # attention_scaling of the rope variant (yarn etc.)
    attn_scale: float | None = None  # softmax scale when not 1/sqrt(head_dim) (gemma3: query_pre_attn_scalar)
    # sliding-window layers (gemma3): their window and their own rope (inverse frequencies, attention_scaling)
    sliding_window: int = 0
    local_inv_freq: torch.Tensor | None = field(default=None, repr=False)
    local_rope_scaling: float = 1.0
    logit_softcap: float | None = None  # final logits: cap * tanh(logits / cap)

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


def model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise QconvError(
            "not a model folder or qconv artifact (no config.json)",
            where=str(path),
            fix="pass the folder written by `qconv build` or an HF model folder",
        )
    read_model_config(path)  # damaged files are one clear error here, not a traceback from the loader
    check_weight_files(path)
    return path


def _rope(hf, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float, int]:
    """Inverse frequencies via transformers' rope registry (llama3, yarn, ... included); default computed here.
    `layer_type`: the rope of that layer type, where the config keeps one per type (gemma3)."""
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


def _eos_ids(path: Path, *configs) -> list[int]:
    """eos ids of the model configs and generation_config.json, in order, each once."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").is_file():
        configs += (GenerationConfig.from_pretrained(path),)
    ids: list[int] = []
    for c in configs:
        eos = getattr(c, "eos_token_id", None)
        for e in [eos] if isinstance(eos, int) else eos or []:
            if int(e) not in ids:
                ids.append(int(e))
    return ids


def load_config(path: str | Path, *, has_mtp: bool = False) -> EngineConfig:
    """Read `path/config.json`; raise QconvError for architectures this engine does not implement."""
    from transformers import AutoConfig

    path = model_dir(path)
    top = AutoConfig.from_pretrained(path)
    mt = top.model_type
    hf, prefix = top, "model."
    if mt == "qwen3_5":  # multimodal wrapper: text weights live under model.language_model.
        hf, prefix = top.get_text_config(), "model.language_model."
    supported = LLAMA_FAMILY + QWEN35_FAMILY + GEMMA3_FAMILY
    if mt not in supported:
        raise QconvError(
            f"model_type {mt!r} is not supported by the bundled engine",
            where=str(path),
            fix=f"supported: {', '.join(supported)}",
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    qwen35, gemma3 = mt in QWEN35_FAMILY, mt in GEMMA3_FAMILY
    inv_freq, rscale, rdim = _rope(hf, head_dim, "full_attention" if gemma3 else None)
    n = hf.num_hidden_layers
    cfg = EngineConfig(
        family="qwen3_5" if qwen35 else "gemma3" if gemma3 else "llama",
        model_type=mt,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=n,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        rms_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        eos_token_ids=_eos_ids(path, top, hf),
        tie_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", mt == "qwen2")),
        qk_norm=mt in ("qwen3",) + QWEN35_FAMILY + GEMMA3_FAMILY,
        attn_output_gate=qwen35,
        norm_offset=1.0 if qwen35 or gemma3 else 0.0,
        rotary_dim=rdim,
        layer_types=list(getattr(hf, "layer_types", None) or ["full_attention"] * n),
        has_mtp=has_mtp,
        weight_prefix=prefix,
        inv_freq=inv_freq,
        rope_scaling=rscale,
    )
    if qwen35:
        cfg.linear_num_k_heads, cfg.linear_num_v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
        cfg.linear_k_head_dim, cfg.linear_v_head_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
        cfg.conv_kernel = hf.linear_conv_kernel_dim
    if gemma3:
        if getattr(hf, "attn_logit_softcapping", None):
            raise QconvError(
                "attention logit soft-capping is not implemented by the bundled engine",
                where=str(path / "config.json"),
                fix="serve this model with --backend vllm",
            )
        cfg.attn_scale = float(hf.query_pre_attn_scalar) ** -0.5
        cfg.sliding_window = int(hf.sliding_window or 0)
        cfg.local_inv_freq, cfg.local_rope_scaling, _ = _rope(hf, head_dim, "sliding_attention")
        cfg.logit_softcap = getattr(hf, "final_logit_softcapping", None)
    return cfg
