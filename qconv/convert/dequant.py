"""Dequantize compressed-tensors weights model-free, with compressed-tensors' own compressors: each module matches its
config group by name (class targets such as "Linear" inferred from the name, since no model is built) and is
decompressed by the compressor of the format it is stored in. The one dequantizer of the package: the engine's
loader and the layer-streamed eval both read weights through it (transformers' own loader is qconv.load_causal_lm's).
A matrix taller than `block_rows` is done a block of rows at a time: compressed-tensors holds about twice the
result in temporaries (5 GB for a 248,320 x 5,120 INT8 lm_head), and the rows of a group- or channel-quantized
weight dequantize independently."""

from __future__ import annotations

import torch

from qconv.errors import QconvError

BLOCK_ROWS = 8192
QPARAM_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_global_scale",
    "input_global_scale",
    "weight_g_idx",
)
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


def quantized_modules(qcfg: dict, tensors: dict[str, torch.Tensor], where: str):
    """(module name, scheme, stored format) for every compressed module of the checkpoint; None if not compressed."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    if qcfg.get("quant_method") != "compressed-tensors":
        raise QconvError(
            f"unsupported quantization method {qcfg.get('quant_method')!r}",
            where=where,
            fix="the bundled engine loads compressed-tensors artifacts (qconv build) or plain folders",
        )
    config = QuantizationConfig.model_validate(qcfg)
    if config.quantization_status != "compressed":
        return None  # frozen/fake-quant checkpoints keep dense weights
    found = []
    for mod in sorted({k.rpartition(".")[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale"))}):
        if any(match_name(mod, ig) for ig in config.ignore):
            continue
        scheme = _scheme_for(mod, config.config_groups, match_name)
        if scheme is None:
            raise QconvError(f"quantized module {mod} matches no config group", where=where)
        found.append((mod, scheme, _stored_format(mod, tensors, scheme.format or config.format)))
    return found


def dequantize_tensors(
    qcfg: dict,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    where: str = "",
    block_rows: int | None = None,
    rotations: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor, each compressed module's qparams replaced by its dense `weight` in `dtype` (decompressed in
    float32, rounded once), input rotations folded in (qconv.convert.rotation; `rotations`: the checkpoint's
    rotation tensors when `tensors` is only part of it); the KV-cache scales are dropped."""
    from qconv.convert.rotation import fold_rotations

    return fold_rotations(qcfg, _dequantized(qcfg, tensors, dtype, where, block_rows), rotations, where)


def _dequantized(qcfg: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, where: str, block_rows: int | None):
    from compressed_tensors.compressors import BaseCompressor

    modules = quantized_modules(qcfg, tensors, where)
    if modules is None:
        return tensors
    out = dict(tensors)
    for mod, scheme, fmt in modules:
        compressor = BaseCompressor.get_value_from_registry(fmt)
        local = {p: out.pop(f"{mod}.{p}") for p in compressor.compression_param_names(scheme) if f"{mod}.{p}" in out}
        if "weight" not in local and f"{mod}.weight" in out:
            local["weight"] = out.pop(f"{mod}.weight")
        out[f"{mod}.weight"] = _decompress(compressor, scheme, local, dtype, block_rows or BLOCK_ROWS)
        for suffix in QPARAM_SUFFIXES:
            out.pop(f"{mod}.{suffix}", None)
    return {k: v for k, v in out.items() if not k.endswith(KV_SCALES)}


def _decompress(compressor, scheme, local: dict[str, torch.Tensor], dtype: torch.dtype, block_rows: int):
    stored = local.get("weight_packed", local.get("weight"))
    rows = stored.shape[0] if stored is not None and stored.dim() == 2 else 0
    if (
        rows <= block_rows
        or "weight_scale" not in local
        or any(t.dim() == 2 and t.shape[0] != rows for t in local.values())
    ):
        return _decompress_block(compressor, scheme, local, dtype)
    weight = None
    for a in range(0, rows, block_rows):
        part = {k: (t[a : a + block_rows] if t.dim() == 2 else t) for k, t in local.items()}
        if "weight_shape" in local:
            part["weight_shape"] = torch.tensor([min(block_rows, rows - a), int(local["weight_shape"][1])])
        w = _decompress_block(compressor, scheme, part, dtype)
        if weight is None:
            weight = torch.empty(rows, w.shape[1], dtype=dtype)
        weight[a : a + len(w)] = w
    return weight


def _decompress_block(compressor, scheme, local: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    local = {p: t.float() if t.is_floating_point() else t for p, t in local.items()}
    return compressor.decompress(local, scheme)["weight"].to(dtype)
