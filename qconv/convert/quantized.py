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

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qconv.errors import QconvError

log = logging.getLogger(__name__)

SHARD_BYTES = 512 << 20  # output shard bound: the writer holds one shard in memory
_AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
_SOURCE_PARAMS = ("qweight", "qzeros", "scales", "g_idx")
_CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


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


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R, C * 32 / bits], element j of each word in bits [j*b, (j+1)*b)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> [R * 32 / bits, C], element j of each word on row r*32/b + j."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, packed.shape[1])


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
        q = _unpack_rows(qweight, bits).t()
        zero = _unpack_cols(qzeros, bits)[:, :n].t() + fmt.zero_offset
    else:
        q = _awq_natural(_unpack_cols(qweight, bits), bits).t()
        zero = _awq_natural(_unpack_cols(qzeros, bits), bits)[:, :n].t()
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


class ShardWriter:
    """Writes tensors to safetensors shards of at most SHARD_BYTES (plus one tensor), one shard in memory."""

    def __init__(self, out: Path, prefix: str = "model", max_bytes: int = SHARD_BYTES):
        self.out, self.prefix, self.max_bytes = out, prefix, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.count = 0, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.pending[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        self.count += 1
        save_file(self.pending, self.out / f"{self.prefix}-{self.count:05d}.safetensors", metadata={"format": "pt"})
        self.pending, self.size = {}, 0


@dataclass
class Converted:
    """What a streamed conversion did, per module name, for the manifest."""

    kept: dict[str, dict] = field(default_factory=dict)  # already-quantized module -> {bits, group_size, symmetric}
    requantized: dict[str, dict] = field(default_factory=dict)  # high-precision module -> {bits, group_size}
    copied: list[str] = field(default_factory=list)  # tensors copied as they are
    groups: dict[tuple[int, int, bool], list[str]] = field(default_factory=dict)
    passthrough: dict | None = None  # a compressed-tensors source's own quantization_config


def _modules(names: list[str], params: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in names:
        mod, _, leaf = n.rpartition(".")
        if leaf in params:
            out.setdefault(mod, []).append(n)
    return out


def stream_convert(src: Path, fmt: QuantFormat, out: Path, requantize=None) -> Converted:
    """Convert every source shard tensor by tensor (safe_open, one module in memory at a time) into `out`.

    `requantize(name, shape) -> QuantizationArgs | None` picks the high-precision weights to quantize (the build's
    embed/lm_head INT8); they are read and quantized in row blocks (rtn_pack)."""
    from safetensors import safe_open

    done = Converted()
    writer = ShardWriter(out)
    where = str(src)
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names = list(f.keys())
            qmods = {} if fmt.layout == "compressed-tensors" else _modules(names, _SOURCE_PARAMS)
            qmods = {m: ns for m, ns in qmods.items() if f"{m}.qweight" in names}
            ctmods = _modules(names, _CT_SUFFIXES) if fmt.layout == "compressed-tensors" else {}
            handled = {n for ns in qmods.values() for n in ns}

            def get(name, *default, names=names, shard=shard):
                if name not in names:
                    if default:
                        return default[0]
                    raise QconvError(
                        f"tensor {name} is missing from {shard.name}",
                        where=where,
                        fix="re-download the checkpoint (every quantized module needs qweight, "
                        "qzeros and scales in one shard)",
                    )
                return f.get_tensor(name)

            for mod in sorted(qmods):
                m = read_module(get, mod, fmt, where)
                for k, t in compressed_tensors_of(m, mod, where).items():
                    writer.add(k, t)
                done.kept[mod] = {"bits": m.bits, "group_size": m.group_size, "symmetric": m.symmetric}
                done.groups.setdefault(scheme_key(m), []).append(mod)
            for name in names:
                if name in handled:
                    continue
                mod = name.rpartition(".")[0]
                if mod in ctmods:  # already compressed: the bytes go through unchanged
                    done.kept.setdefault(mod, {"format": "compressed-tensors"})
                    writer.add(name, f.get_tensor(name))
                    continue
                sl = f.get_slice(name)
                args = requantize(name, tuple(sl.get_shape())) if requantize is not None else None
                if args is None:
                    writer.add(name, f.get_tensor(name))
                    done.copied.append(name)
                    continue
                for k, v in rtn_pack(sl, mod, args).items():
                    writer.add(k, v)
                done.requantized[mod] = {"bits": args.num_bits, "group_size": args.group_size, "method": "rtn"}
                done.groups.setdefault((args.num_bits, args.group_size, True), []).append(mod)
    writer.flush()
    return done


RTN_BLOCK_ROWS = 8192  # rows of a high-precision weight quantized at a time (bounds the fp32 work copy)


def rtn_pack(sl, mod: str, args, block_rows: int = RTN_BLOCK_ROWS) -> dict[str, torch.Tensor]:
    """Round-to-nearest symmetric group quantization of one weight (qparams as calibrate_embeddings gives them),
    packed by compressed-tensors' pack-quantized compressor; read from `sl` (a safetensors slice) in row blocks."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    comp = BaseCompressor.get_value_from_registry(CompressionFormat.pack_quantized.value)
    scheme = QuantizationScheme(targets=[mod], weights=args, format=CompressionFormat.pack_quantized.value)
    n, k = sl.get_shape()
    packed, scales = [], []
    for r0 in range(0, n, block_rows):
        w = sl[r0 : min(r0 + block_rows, n)]
        wg = w.float().view(w.shape[0], k // args.group_size, args.group_size)
        scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
        scale = scale.to(w.dtype)
        sd = comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        packed.append(sd["weight_packed"])
        scales.append(sd["weight_scale"])
    return {
        f"{mod}.weight_packed": torch.cat(packed),
        f"{mod}.weight_scale": torch.cat(scales),
        f"{mod}.weight_shape": torch.tensor([n, k]),
    }


def write_config(src: Path, out: Path, qcfg: dict) -> None:
    """The source's config.json with its quantization_config replaced (top level, where loaders look)."""
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def copy_model_files(src: Path, out: Path) -> None:
    """Tokenizer, chat template and generation config: everything but weights, config and the source's
    own quantization side files."""
    from qconv.convert.artifact import copy_side_files

    copy_side_files(src, out)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out / "generation_config.json")
