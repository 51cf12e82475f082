"""Writing an already-quantized checkpoint out as compressed-tensors: shards streamed tensor by tensor from the
source (one module in memory), high-precision weights the build quantizes packed by round-to-nearest, the config
and the side files. The reading and repacking of each module is qconv.convert.quantized."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qconv.convert.quantized import QuantFormat, compressed_tensors_of, read_module, scheme_key
from qconv.errors import QconvError

SHARD_BYTES = 512 << 20  # output shard bound: the writer holds one shard in memory
_SOURCE_PARAMS = ("qweight", "qzeros", "scales", "g_idx")
_CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


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
    from qconv.convert.finish import copy_side_files

    copy_side_files(src, out)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out / "generation_config.json")
