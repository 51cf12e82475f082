"""The integer form of a compressed-tensors checkpoint's int4/int8 modules, for int_linear.py's kernels (their dense
form comes from qconv.convert.dequant)."""

from __future__ import annotations

import torch

from qconv.convert.dequant import quantized_modules
from qconv.convert.rotation import input_rotations
from qconv.engine.int_linear import IntWeight


def int_weights(qcfg: dict, tensors: dict[str, torch.Tensor], where: str = "") -> dict[str, IntWeight]:
    """The integer values, scales and (int4) zero points of every group/channel-quantized 4- or 8-bit module,
        unpacked with compressed-tensors' own helper (checkpoint module names). Modules in other forms (8-bit zero
        points, activation-order g_idx, other bit widths) are left out: they run dequantized. A rotated module's IntWeight carries
    its input rotation (qconv.convert.rotation), which the int kernel applies to its input."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.config import CompressionFormat

    found = quantized_modules(qcfg, tensors, where) or []
    rotated = input_rotations(qcfg, {mod: _in_features(tensors, mod) for mod, _, _ in found}, tensors, where)
    out: dict[str, IntWeight] = {}
    for mod, scheme, fmt in found:
        args = scheme.weights
        if (
            args is None
            or args.num_bits not in (4, 8)
            or not (args.symmetric or (args.num_bits == 4 and f"{mod}.weight_zero_point" in tensors))
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
        zero = None
        if not args.symmetric:  # packed along the output dim, 4 bits a group (compressed-tensors' layout)
            zero = unpack_from_int32(tensors[f"{mod}.weight_zero_point"], 4, scale.shape, packed_dim=0)
        rot = rotated[mod].matrix() if mod in rotated else None
        out[mod] = IntWeight(args.num_bits, q, scale, zero, rot)
    return out


def _in_features(tensors: dict[str, torch.Tensor], mod: str) -> int:
    shape = tensors.get(f"{mod}.weight_shape")
    return int(shape[1]) if shape is not None else tensors[f"{mod}.weight"].shape[-1]
