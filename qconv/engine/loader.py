"""Load a plain HF folder or a qconv (compressed-tensors) artifact into our model: dequantized on load, and for bf16
on CPU the int4 Linears and int8 embedding also run from their integer form (int_linear.py). Checkpoint names map to
ours: q/k/v, gate/up and the GDN input projections fuse into one matrix each; qwen3_5's (1 + w) norms fold the +1."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qconv.compute import bf16_native, dtype_name
from qconv.convert.dequant import dequantize_tensors
from qconv.engine.cache import ModelCache
from qconv.engine.config import as_spec, load_config
from qconv.engine.cpu_pack import PackedLinear, pack_linears, packing_available
from qconv.engine.int_linear import Int4Linear, Int8Embedding, IntWeight, attach_int_kernels, int_kernels_available
from qconv.engine.quant import int_weights
from qconv.errors import QconvError
from qconv.modelfiles import load_tokenizer as read_tokenizer
from qconv.models.blocks import Transformer
from qconv.models.config import EngineConfig
from qconv.models.family import Family
from qconv.models.spec import ModelSpec


def part_of(family: Family) -> dict[str, tuple[str, tuple[str, ...]]]:
    """checkpoint projection -> (our fused module, its parts in order), from the family's fused groups."""
    return {part: (f.engine, f.parts) for f in family.fused for part in f.parts}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QconvError(
            "no *.safetensors in model folder",
            where=str(path),
            fix="pass a folder saved with save_pretrained(safe_serialization=True)",
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def our_int_weights(
    path: Path | ModelSpec, tensors: dict[str, torch.Tensor], cfg: EngineConfig
) -> dict[str, IntWeight]:
    """The artifact's integer weights under our module names, fused like the dense ones; a fused projection whose
    parts differ in format (or are not all quantized) is left out and runs dense."""
    spec = as_spec(path)
    qcfg = spec.config.get("quantization_config")
    found = int_weights(qcfg, tensors, where=str(spec.folder)) if qcfg else {}
    named = ((ours, w) for name, w in found.items() if (ours := _our_name(name + ".weight", cfg)) is not None)
    fused, _ = _fuse(named, IntWeight.cat, part_of(spec.family))
    return {name.removesuffix(".weight"): w for name, w in fused.items() if w is not None}


def _our_name(name: str, cfg: EngineConfig) -> str | None:
    if name.startswith(cfg.weight_prefix):
        name = name[len(cfg.weight_prefix) :]
    elif name.startswith("model.") and cfg.weight_prefix != "model.":
        return None  # vision tower etc. of a multimodal checkpoint
    elif name.startswith("lm_head.") and cfg.tie_embeddings:
        return None
    elif not name.startswith(("lm_head.", "mtp.")):
        return None
    name = name.replace(".self_attn.", ".mixer.").replace(".linear_attn.", ".mixer.")
    if name.startswith("mtp.layers.0."):  # our MTP head holds one block
        name = "mtp.block." + name[len("mtp.layers.0.") :]
    return name


def _fuse(named, cat, parts_of: dict[str, tuple[str, tuple[str, ...]]]) -> tuple[dict, dict]:
    """(our name, value) pairs with the parts of each fused projection joined by `cat` (in the family's order), and
    the fused projections some of whose parts never came."""
    out, pending = {}, {}
    for name, t in named:
        module, _, param = name.rpartition(".")
        owner, _, leaf = module.rpartition(".")
        if leaf not in parts_of:
            out[name] = t
            continue
        fused, parts = parts_of[leaf]
        key = f"{owner}.{fused}.{param}"
        got = pending.setdefault(key, {})
        got[leaf] = t
        if len(got) == len(parts):
            del pending[key]
            out[key] = cat([got[p] for p in parts])
    return out, pending


def convert_state_dict(
    tensors: dict[str, torch.Tensor], cfg: EngineConfig, family: Family, dtype
) -> dict[str, torch.Tensor]:
    offset_norm = re.compile(family.offset_norms)  # norms computing x * (offset + w); GDN's own norm uses plain w

    def ours():
        for name, t in tensors.items():
            name = _our_name(name, cfg)
            if name is None:
                continue
            t = t.to(dtype) if t.is_floating_point() else t
            if cfg.norm_offset and offset_norm.search(name):
                t = (t.float() + cfg.norm_offset).to(dtype)
            if name.endswith(".conv1d.weight"):  # [C, 1, K] -> [C, K]
                name, t = name.replace(".conv1d.weight", ".conv_weight"), t.squeeze(1)
            yield name, t

    sd, pending = _fuse(ours(), torch.cat, part_of(family))
    if pending:
        raise QconvError(f"checkpoint has incomplete fused projections: {sorted(pending)[:3]}")
    return sd


def engine_dtype(path: Path | ModelSpec, dequantize: bool = False, requested: str | None = None) -> torch.dtype:
    """The dtype the CLI runs a model in: `requested` ("float32" / "bfloat16") when given; else bf16 for a
    compressed artifact when the CPU int kernels exist and the CPU computes bf16 natively (its int4 Linears then run
    as int4), else float32 (dequantized on load). dequantize=True forces the float32 path."""
    if requested and requested != "auto":
        return getattr(torch, requested)
    compressed = (as_spec(path).config.get("quantization_config") or {}).get("quantization_status") == "compressed"
    use_int = (
        compressed and not dequantize and int_kernels_available(torch.device("cpu"), torch.bfloat16) and bf16_native()
    )
    return torch.bfloat16 if use_int else torch.float32


def load_model(
    path, *, dtype: torch.dtype = torch.float32, pack: bool | None = None, int_kernels: bool | None = None
) -> Transformer:
    """A plain HF folder (llama/qwen2/qwen3/qwen3_5) or a qconv artifact -> our Transformer, eval mode.

    pack: repack Linear weights into oneDNN's layout for faster CPU decode (default: on CPU when available).
    int_kernels: run an artifact's int4 Linears through torch's CPU int4 kernel and look its int8 embedding up from
    the int8 table (default: on for bf16 on CPU when the kernels exist; False = dequantized only)."""
    spec = as_spec(path)
    path = spec.folder
    if int_kernels is None:
        int_kernels = int_kernels_available(torch.device("cpu"), dtype)
    elif int_kernels and not int_kernels_available(torch.device("cpu"), dtype):
        raise QconvError(
            f"int kernels need bfloat16 on a CPU torch with the int4 kernel (got {dtype})",
            fix="load with dtype=torch.bfloat16, or int_kernels=False",
        )
    raw = read_safetensors(path)
    qcfg = spec.config.get("quantization_config")
    tensors = dequantize_tensors(qcfg, raw, dtype, where=str(path)) if qcfg else raw
    cfg = load_config(spec, has_mtp=any(k.startswith("mtp.fc.") for k in tensors))
    cfg.attention_bias = any(k.endswith("self_attn.q_proj.bias") for k in tensors)
    cfg.o_bias = any(k.endswith("self_attn.o_proj.bias") for k in tensors)
    sd = convert_state_dict(tensors, cfg, spec.family, dtype)
    with torch.device("meta"):
        model = spec.family.transformer(cfg, ModelCache.create)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise QconvError(
            f"checkpoint does not match the {cfg.model_type} model: missing {missing[:4]}, unexpected {unexpected[:4]}",
            where=str(path),
        )
    packed = pack if pack is not None else packing_available(model.device, dtype)
    if packed:
        pack_linears(model)
        if model.lm_head is None:
            model.tied_head = PackedLinear(model.embed_tokens.weight, None)
    if int_kernels:
        attach_int_kernels(model, our_int_weights(spec, raw, cfg))
    return model.eval()


def load_for_engine(path, dequantize: bool = False, dtype: str | None = None) -> Transformer:
    """The model as `qconv generate` and `qconv serve` run it: `engine_dtype`'s dtype, and the CPU int kernels
    unless `dequantize`. `path`: a model folder or its ModelSpec."""
    spec = as_spec(path)
    return load_model(spec, dtype=engine_dtype(spec, dequantize, dtype), int_kernels=False if dequantize else None)


def describe_engine(model: Transformer) -> str:
    """One phrase for a startup line: the dtype and which weights run through the int kernels."""
    dtype = dtype_name(model.norm.weight.dtype)
    n4 = sum(isinstance(m, Int4Linear) for m in model.modules())
    n8 = sum(isinstance(m, Int8Embedding) for m in model.modules())
    kernels = [f"int4 kernels on {n4} Linears"] * bool(n4) + ["int8 embedding lookup"] * bool(n8)
    return f"{dtype}, " + (" + ".join(kernels) if kernels else "dense weights (no int kernels)")


def load_tokenizer(path):
    """The model folder's tokenizer (qconv.modelfiles: unreadable tokenizer files are one clear error)."""
    return read_tokenizer(path)
