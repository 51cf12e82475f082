"""Dequantize a compressed-tensors checkpoint on load, model-free, with compressed-tensors' own compressors.

Each quantized module is matched to its config group by name (regex / exact targets first, then class targets such as
"Linear" or "Embedding", whose class is inferred from the name since no model is built), and decompressed with the
compressor for the format its tensors are actually stored in."""

from __future__ import annotations

import torch

from qconv.errors import QconvError

QPARAM_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale",
                   "input_global_scale", "weight_g_idx")
KV_SCALES = ("k_scale", "v_scale", "q_scale")


def _module_class(name: str) -> str:
    return "Embedding" if name.endswith("embed_tokens") else "Linear"


def _scheme_for(name: str, groups: dict, match_name) -> object | None:
    by_class = None
    for scheme in groups.values():
        for target in scheme.targets:
            if target in ("Linear", "Embedding"):
                if by_class is None and target == _module_class(name):
                    by_class = scheme
            elif match_name(name, target):
                return scheme
    return by_class


def _stored_format(mod: str, tensors: dict[str, torch.Tensor], declared: str | None) -> str:
    from compressed_tensors.config import CompressionFormat

    if f"{mod}.weight_packed" in tensors:
        return CompressionFormat.pack_quantized.value
    w = tensors.get(f"{mod}.weight")
    if w is not None and not w.is_floating_point():
        return CompressionFormat.int_quantized.value
    return declared or CompressionFormat.naive_quantized.value


def dequantize_tensors(qcfg: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                       where: str = "") -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    if qcfg.get("quant_method") != "compressed-tensors":
        raise QconvError(f"unsupported quantization method {qcfg.get('quant_method')!r}", where=where,
                         fix="the bundled runtime loads compressed-tensors artifacts (qconv build) or plain folders")
    config = QuantizationConfig.model_validate(qcfg)
    if config.quantization_status != "compressed":
        return tensors  # frozen/fake-quant checkpoints keep dense weights
    out = dict(tensors)
    modules = sorted({k.rpartition(".")[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale"))})
    for mod in modules:
        if any(match_name(mod, ig) for ig in config.ignore):
            continue
        scheme = _scheme_for(mod, config.config_groups, match_name)
        if scheme is None:
            raise QconvError(f"quantized module {mod} matches no config group", where=where)
        fmt = _stored_format(mod, tensors, scheme.format or config.format)
        compressor = BaseCompressor.get_value_from_registry(fmt)
        local = {p: out.pop(f"{mod}.{p}") for p in compressor.compression_param_names(scheme)
                 if f"{mod}.{p}" in out}
        local = {p: t.float() if t.is_floating_point() else t for p, t in local.items()}  # dequantize in fp32
        if "weight" not in local and f"{mod}.weight" in out:
            local["weight"] = out.pop(f"{mod}.weight")
        out[f"{mod}.weight"] = compressor.decompress(local, scheme)["weight"].to(dtype)
        for suffix in QPARAM_SUFFIXES:
            out.pop(f"{mod}.{suffix}", None)
    return {k: v for k, v in out.items() if not k.endswith(KV_SCALES)}
