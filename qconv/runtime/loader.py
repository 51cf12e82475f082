"""Load a plain HF folder or a qconv (compressed-tensors) artifact into our model, dequantizing on load.

Checkpoint names are mapped to ours here: q/k/v and gate/up (and the four GDN input projections) are fused into one
matrix each, and qwen3_5's zero-centred norms get their +1 folded into the weight."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from qconv.errors import QconvError
from qconv.runtime.config import RuntimeConfig, load_config
from qconv.runtime.cpu_pack import PackedLinear, pack_linears, packing_available
from qconv.runtime.model import Transformer

FUSED = {  # our name -> checkpoint names concatenated along the output dim, in order
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}
PART_OF = {part: (fused, parts) for fused, parts in FUSED.items() for part in parts}
# qwen3_5 norms that compute x * (1 + w); the GDN output norm (linear_attn.norm) uses plain w.
OFFSET_NORM = re.compile(r"(layernorm|q_norm|k_norm|pre_fc_norm_\w+|^norm|mtp\.norm)\.weight$")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QconvError("no *.safetensors in model folder", where=str(path),
                         fix="pass a folder saved with save_pretrained(safe_serialization=True)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def dequantize(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Replace compressed-tensors modules (weight_packed / int8 weight + scales) by dense weights."""
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config")
    if not qcfg:
        return tensors
    from qconv.runtime.quant import dequantize_tensors

    return dequantize_tensors(qcfg, tensors, dtype, where=str(path))


def _our_name(name: str, cfg: RuntimeConfig) -> str | None:
    if name.startswith(cfg.weight_prefix):
        name = name[len(cfg.weight_prefix):]
    elif name.startswith("model.") and cfg.weight_prefix != "model.":
        return None  # vision tower etc. of a multimodal checkpoint
    elif name.startswith("lm_head.") and cfg.tie_embeddings:
        return None
    elif not name.startswith(("lm_head.", "mtp.")):
        return None
    name = name.replace(".self_attn.", ".mixer.").replace(".linear_attn.", ".mixer.")
    if name.startswith("mtp.layers.0."):  # our MTP head holds one block
        name = "mtp.block." + name[len("mtp.layers.0."):]
    return name


def convert_state_dict(tensors: dict[str, torch.Tensor], cfg: RuntimeConfig, dtype) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        ours = _our_name(name, cfg)
        if ours is None:
            continue
        t = t.to(dtype) if t.is_floating_point() else t
        if cfg.norm_offset and OFFSET_NORM.search(ours):
            t = t.float() + cfg.norm_offset
            t = t.to(dtype)
        if ours.endswith(".conv1d.weight"):  # [C, 1, K] -> [C, K]
            ours, t = ours.replace(".conv1d.weight", ".conv_weight"), t.squeeze(1)
        module, _, param = ours.rpartition(".")
        owner, _, leaf = module.rpartition(".")
        if leaf in PART_OF:
            fused, parts = PART_OF[leaf]
            key = f"{owner}.{fused}.{param}"
            pending.setdefault(key, {})[leaf] = t
            if len(pending[key]) == len(parts):
                got = pending.pop(key)
                sd[key] = torch.cat([got[p] for p in parts], dim=0)
            continue
        sd[ours] = t
    if pending:
        raise QconvError(f"checkpoint has incomplete fused projections: {sorted(pending)[:3]}")
    return sd


def load_model(path, *, dtype: torch.dtype = torch.float32, max_batch: int = 1, pack: bool | None = None
               ) -> Transformer:
    """A plain HF folder (llama/qwen2/qwen3/qwen3_5) or a qconv artifact -> our Transformer, eval mode.

    pack: repack Linear weights into oneDNN's layout for faster CPU decode (default: on CPU when available)."""
    path = Path(path)
    tensors = dequantize(path, read_safetensors(path), dtype)
    cfg = load_config(path, has_mtp=any(k.startswith("mtp.fc.") for k in tensors))
    cfg.attention_bias = any(k.endswith("self_attn.q_proj.bias") for k in tensors)
    cfg.o_bias = any(k.endswith("self_attn.o_proj.bias") for k in tensors)
    sd = convert_state_dict(tensors, cfg, dtype)
    if cfg.family == "qwen3_5":
        from qconv.runtime.qwen35 import Qwen35Transformer as cls
    else:
        cls = Transformer
    with torch.device("meta"):
        model = cls(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise QconvError(f"checkpoint does not match the {cfg.model_type} model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}", where=str(path))
    model.config.inv_freq = cfg.inv_freq
    model.max_batch = max_batch
    if pack if pack is not None else packing_available(model.device, dtype):
        pack_linears(model)
        if model.lm_head is None:
            model.tied_head = PackedLinear(model.embed_tokens.weight, None)
    return model.eval()


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path))
