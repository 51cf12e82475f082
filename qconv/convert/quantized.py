"""Already-quantized checkpoints (GPTQ, AWQ, AutoRound, compressed-tensors) -> compressed-tensors `pack-quantized`,
losslessly: the integer codes, scales and zero points are unpacked from the source layout and repacked with
compressed-tensors' own packing, never requantized, so the dequantized weights are the source's, bit for bit.

Layouts (read from the libraries that write them, auto-round 0.15 / AutoGPTQ / AutoAWQ):
- GPTQ: qweight [K*b/32, N] int32 packs input rows, low bits first; qzeros [K/g, N*b/32] packs output columns;
  scales [K/g, N]; w[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]). AutoGPTQ's v1 stores z - 1 (the
  reader adds 1); GPTQModel's `checkpoint_format: gptq_v2` and AutoRound's plain `auto_round` packing store z.
- AWQ (GEMM): qweight [K, N*b/32] and qzeros [K/g, N*b/32] pack output columns in the order 0,2,4,6,1,3,5,7.
- compressed-tensors: copied byte for byte.

Activation order: GPTQ's desc_act without static groups stores g_idx = invperm // group_size (GPTQModel
quantization/gptq.py GPTQ.quantize), each input column in an arbitrary group. compressed-tensors 0.19 has no form for
that: QuantizationArgs.validate_actorder rejects actorder "group"/"dynamic", and the pack-quantized compressor's
compression_param_names and forward.dequantize take no g_idx. vLLM 0.32 refuses it on both paths
(CompressedTensorsConfig._quantization_scheme_map_from_config for actorder group; gptq_utils.
normalize_and_validate_gptq_desc_act for GPTQ desc_act) and drops `.g_idx` at load (QuantizationConfig.
get_checkpoint_weight_mapper). Moving the permutation into the weights would need the input activations permuted
too, which only the previous layer could do. So a g_idx that is the plain group map (desc_act=False, or desc_act
with static groups) is verified and dropped; any other is refused, from a scan of the g_idx tensors alone, before
anything is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qconv.errors import QconvError
from qconv_vllm.packing import unpack_int32

_AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


@dataclass(frozen=True)
class QuantFormat:
    """What a checkpoint's quantization_config says about how its tensors are laid out."""

    method: str  # quant_method as written: gptq | awq | auto-round | compressed-tensors
    layout: str  # gptq | awq | compressed-tensors
    zero_offset: int = 0  # added to stored zero points (GPTQ v1 stores z - 1)
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    packing: str = ""
    dynamic: dict = field(default_factory=dict, hash=False)  # GPTQ `dynamic` per-module overrides (+:re / -:re)

    def bits_for(self, module: str) -> int:
        for pat, cfg in self.dynamic.items():
            if pat.startswith("+:") and re.match(pat[2:], module) and "bits" in cfg:
                return int(cfg["bits"])
        return self.bits

    def summary(self) -> dict:
        return {
            "method": self.method,
            "layout": self.layout,
            "packing": self.packing,
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.desc_act,
        }


def quantization_config_of(config: dict) -> dict:
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}


def detect_format(config: dict, where: str = "config.json") -> QuantFormat | None:
    """The source's quantization format, None for a full-precision checkpoint; an error for one we cannot import."""
    q = quantization_config_of(config)
    method = str(q.get("quant_method", "")).lower()
    if not method:
        return None
    if method == "compressed-tensors":
        return QuantFormat(method=method, layout="compressed-tensors")
    bits, group = int(q.get("bits", q.get("w_bit", 4))), int(q.get("group_size", q.get("q_group_size", 128)))
    common = dict(
        bits=bits,
        group_size=group,
        sym=bool(q.get("sym", not q.get("zero_point", False))),
        desc_act=bool(q.get("desc_act", False)),
        dynamic=dict(q.get("dynamic") or {}),
    )
    if method == "gptq":
        v2 = q.get("checkpoint_format") == "gptq_v2"
        fmt = QuantFormat(
            method=method, layout="gptq", zero_offset=0 if v2 else 1, packing="gptq_v2" if v2 else "gptq", **common
        )
    elif method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise QconvError(
                f"AWQ version {q.get('version')!r} is not supported (only the GEMM layout)",
                where=where,
                fix="export the model with AutoAWQ's GEMM version",
            )
        fmt = QuantFormat(method=method, layout="awq", packing="gemm", **common)
    elif method == "auto-round":
        packing = str(q.get("packing_format", "auto_round:auto_gptq"))
        if str(q.get("data_type", "int")) != "int":
            raise QconvError(
                f"AutoRound data_type {q.get('data_type')!r} is not supported (integer only)",
                where=where,
                fix="import an integer (int4/int8) AutoRound export",
            )
        if "awq" in packing:
            fmt = QuantFormat(method=method, layout="awq", packing=packing, **common)
        elif packing in ("auto_round", "auto_round:gptqmodel", "auto_round:auto_gptq"):
            # auto_round:auto_gptq packs with AutoGPTQ's v1 zero convention (qlinear_torch_zp), the others without
            fmt = QuantFormat(
                method=method,
                layout="gptq",
                zero_offset=1 if packing.endswith("auto_gptq") else 0,
                packing=packing,
                **common,
            )
        else:
            raise QconvError(
                f"AutoRound packing_format {packing!r} is not supported",
                where=where,
                fix="import an auto_round, auto_round:auto_gptq or auto_round:auto_awq export",
            )
    else:
        raise QconvError(
            f"quantization method {method!r} cannot be imported",
            where=where,
            fix="qconv imports gptq, awq, auto-round and compressed-tensors checkpoints, or a bf16 one",
        )
    if fmt.bits not in (4, 8):
        raise QconvError(
            f"{method} checkpoint with {fmt.bits}-bit weights: only 4- and 8-bit import",
            where=where,
            fix="import a 4-bit or 8-bit checkpoint",
        )
    return fmt


def _awq_natural(x: torch.Tensor, bits: int) -> torch.Tensor:
    order = torch.arange(x.shape[1]).view(-1, 32 // bits)[:, _AWQ_REVERSE_ORDER].reshape(-1)
    return x[:, order]


@dataclass
class IntModule:
    """One quantized Linear in plain form: w[n, k] = scale[n, k // g] * (q[n, k] - zero[n, k // g])."""

    bits: int
    q: torch.Tensor  # [N, K] unsigned codes
    zero: torch.Tensor  # [N, K // g] unsigned
    scale: torch.Tensor  # [N, K // g], the source's dtype

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def symmetric(self) -> bool:
        return bool((self.zero == 1 << (self.bits - 1)).all())


def read_module(get, mod: str, fmt: QuantFormat, where: str) -> IntModule:
    """Unpack one module of a GPTQ/AWQ-layout checkpoint; `get(name)` returns a tensor."""
    bits = fmt.bits_for(mod)
    qweight, qzeros, scales = get(f"{mod}.qweight"), get(f"{mod}.qzeros"), get(f"{mod}.scales")
    n = scales.shape[1]
    if fmt.layout == "gptq":
        q = unpack_int32(qweight.t(), bits)  # packed down the input dim: [N, K]
        zero = unpack_int32(qzeros, bits)[:, :n].t() + fmt.zero_offset
    else:
        q = _awq_natural(unpack_int32(qweight, bits), bits).t()
        zero = _awq_natural(unpack_int32(qzeros, bits), bits)[:, :n].t()
    k, groups = q.shape[1], scales.shape[0]
    if q.shape[0] != n or k % groups:
        raise QconvError(
            f"{mod}: qweight {tuple(qweight.shape)} does not fit scales {tuple(scales.shape)} at {bits} bits",
            where=where,
            fix="check the checkpoint's bits / group_size",
        )
    if not _plain_group_order(get(f"{mod}.g_idx", None), groups):
        raise _act_order_error(mod, where)
    return IntModule(bits=bits, q=q.contiguous(), zero=zero.contiguous(), scale=scales.t().contiguous())


def _plain_group_order(g_idx: torch.Tensor | None, groups: int) -> bool:
    """g_idx absent or the plain group map (column k in group k // group_size): see the module doc."""
    if g_idx is None:
        return True
    k = g_idx.numel()
    return k % groups == 0 and torch.equal(g_idx.long(), torch.arange(k) // (k // groups))


def _act_order_error(mod: str, where: str, others: int = 0) -> QconvError:
    more = f" (and {others} more modules)" if others else ""
    return QconvError(
        f"{mod}{more}: activation-order GPTQ (desc_act=True without static groups) stores a permuted g_idx, which "
        "has no lossless compressed-tensors form: compressed-tensors 0.19 removed actorder=group and vLLM 0.32 "
        "refuses group activation order (and GPTQ desc_act) outright",
        where=where,
        fix="re-export the checkpoint with desc_act=False or static_groups=True (GPTQModel/AutoGPTQ), or "
        "actorder='weight' (llm-compressor); or build from the full-precision model with `qconv build --model`",
    )


def check_group_order(src: Path, fmt: QuantFormat) -> None:
    """Before converting anything: every GPTQ-layout g_idx is the plain group map (reads only the g_idx tensors
    and the scales' shapes)."""
    from safetensors import safe_open

    if fmt.layout != "gptq":
        return
    bad = []
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names = set(f.keys())
            for name in sorted(n for n in names if n.endswith(".g_idx") and n[:-6] + ".scales" in names):
                mod = name[: -len(".g_idx")]
                if not _plain_group_order(f.get_tensor(name), f.get_slice(f"{mod}.scales").get_shape()[0]):
                    bad.append(mod)
    if bad:
        raise _act_order_error(bad[0], str(src), len(bad) - 1)


def compressed_tensors_of(m: IntModule, mod: str, where: str) -> dict[str, torch.Tensor]:
    """The module's pack-quantized tensors (compressed-tensors' signed codes q - 2^(b-1), its packing)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    center = 1 << (m.bits - 1)
    out = {
        f"{mod}.weight_packed": pack_to_int32((m.q - center).to(torch.int8), m.bits),
        f"{mod}.weight_scale": m.scale,
        f"{mod}.weight_shape": torch.tensor(list(m.q.shape)),
    }
    if not m.symmetric:
        zp = m.zero - center
        if zp.min() < -center or zp.max() >= center:
            raise QconvError(
                f"{mod}: zero point {int(m.zero.max())} is outside the {m.bits}-bit range (a GPTQ v1 "
                f"zero of 0 wraps to 2^{m.bits})",
                where=where,
                fix="this checkpoint's zero points cannot be stored losslessly in compressed-tensors",
            )
        out[f"{mod}.weight_zero_point"] = pack_to_int32(zp.to(torch.int8), m.bits, packed_dim=0).contiguous()
    return out


def scheme_key(m: IntModule) -> tuple[int, int, bool]:
    return (m.bits, m.group_size, m.symmetric)


def quantization_config(groups: dict[tuple[int, int, bool], list[str]], ignore: list[str]) -> dict:
    """compressed-tensors config: one group per (bits, group size, symmetric), targeting modules by exact name."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    cg = {}
    for i, ((bits, g, sym), names) in enumerate(sorted(groups.items())):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=g)
        cg[f"group_{i}"] = QuantizationScheme(targets=sorted(names), weights=args, format="pack-quantized")
    cfg = QuantizationConfig(config_groups=cg, format="pack-quantized", quantization_status="compressed", ignore=ignore)
    return cfg.to_dict()
