"""Dequantize a compressed-tensors checkpoint on load, model-free, with compressed-tensors' own compressors: each
module matches its config group by name (class targets such as "Linear" inferred from the name, since no model is
built) and is decompressed by the compressor of the format it is stored in. `int_weights` feeds int_linear.py."""

from __future__ import annotations

import torch

from qconv.errors import QconvError
from qconv.runtime.int_linear import IntWeight

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


def _quantized_modules(qcfg: dict, tensors: dict[str, torch.Tensor], where: str):
    """(module name, scheme, stored format) for every compressed module of the checkpoint; None if not compressed."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    if qcfg.get("quant_method") != "compressed-tensors":
        raise QconvError(
            f"unsupported quantization method {qcfg.get('quant_method')!r}",
            where=where,
            fix="the bundled runtime loads compressed-tensors artifacts (qconv build) or plain folders",
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
    qcfg: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, where: str = ""
) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import BaseCompressor

    modules = _quantized_modules(qcfg, tensors, where)
    if modules is None:
        return tensors
    out = dict(tensors)
    for mod, scheme, fmt in modules:
        compressor = BaseCompressor.get_value_from_registry(fmt)
        local = {p: out.pop(f"{mod}.{p}") for p in compressor.compression_param_names(scheme) if f"{mod}.{p}" in out}
        local = {p: t.float() if t.is_floating_point() else t for p, t in local.items()}  # dequantize in fp32
        if "weight" not in local and f"{mod}.weight" in out:
            local["weight"] = out.pop(f"{mod}.weight")
        out[f"{mod}.weight"] = compressor.decompress(local, scheme)["weight"].to(dtype)
        for suffix in QPARAM_SUFFIXES:
            out.pop(f"{mod}.{suffix}", None)
    return {k: v for k, v in out.items() if not k.endswith(KV_SCALES)}


def int_weights(qcfg: dict, tensors: dict[str, torch.Tensor], where: str = "") -> dict[str, IntWeight]:
    """The integer values and scales of every symmetric group/channel-quantized 4- or 8-bit module, unpacked with
    compressed-tensors' own helper (checkpoint module names). Modules in other forms (zero points, activation-order
    g_idx, other bit widths) are left out: they run dequantized."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.config import CompressionFormat

    out: dict[str, IntWeight] = {}
    for mod, scheme, fmt in _quantized_modules(qcfg, tensors, where) or []:
        args = scheme.weights
        if (
            args is None
            or args.num_bits not in (4, 8)
            or not args.symmetric
            or args.type != "int"
            or args.strategy not in ("group", "channel")
            or f"{mod}.weight_g_idx" in tensors
            or f"{mod}.weight_scale" not in tensors
        ):
            continue
        scale = tensors[f"{mod}.weight_scale"]
        if fmt == CompressionFormat.pack_quantized.value:
            shape = torch.Size(tensors[f"{mod}.weight_shape"].tolist())
            q = unpack_from_int32(tensors[f"{mod}.weight_packed"], args.num_bits, shape)
        elif fmt == CompressionFormat.int_quantized.value and tensors[f"{mod}.weight"].dtype == torch.int8:
            q = tensors[f"{mod}.weight"]
        else:
            continue
        if q.dim() != 2 or scale.dim() != 2 or q.shape[1] % scale.shape[1]:
            continue
        out[mod] = IntWeight(args.num_bits, q, scale)
    return out
