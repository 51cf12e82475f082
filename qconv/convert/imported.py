"""Artifacts made from an already-quantized checkpoint: `qconv convert quantized` (a lossless import) and `qconv build`
on a quantized source (the import plus the recipe applied to what is still high precision: RTN, no calibration
forward, no GPU, one tensor in memory at a time). Both write a qconv.json that names the source format and which
tensors were kept and which requantized."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from qconv.convert.finish import write_index, write_manifest
from qconv.convert.quantized import (
    QuantFormat,
    check_group_order,
    detect_format,
    quantization_config,
    quantization_config_of,
)
from qconv.convert.repack import Converted, copy_model_files, stream_convert, write_config
from qconv.convert.sources import ResolvedSource, read_config, resolve_source
from qconv.errors import QconvError
from qconv.fsutil import atomic_dir
from qconv.manifest import Manifest, ModuleDecision, SourceInfo
from qconv.recipes.recipe import Recipe
from qconv.recipes.roles import role_of
from qconv.recipes.sections import KEEP

log = logging.getLogger(__name__)


def _final_config(src: Path, fmt: QuantFormat, done: Converted) -> dict:
    """The artifact's quantization_config: the imported (and requantized) groups by exact module name; a
    compressed-tensors source keeps its own groups and gains the requantized ones."""
    from compressed_tensors.utils.match import match_name

    ignore = ["re:^mtp\\..*"] if any(n.startswith("mtp.") for n in done.copied) else []
    if fmt.layout != "compressed-tensors":
        return quantization_config(done.groups, ignore)
    qcfg = dict(quantization_config_of(read_config(src)))
    new = quantization_config(done.groups, []) if done.groups else {"config_groups": {}}
    groups = dict(qcfg.get("config_groups") or {})
    for i, g in enumerate(new["config_groups"].values()):
        groups[f"imported_{i}"] = g
    qcfg["config_groups"] = groups
    qcfg["ignore"] = [ig for ig in qcfg.get("ignore") or [] if not any(match_name(m, ig) for m in done.requantized)]
    return qcfg


def _decisions(done: Converted, fmt: QuantFormat) -> list[ModuleDecision]:
    out = []
    for mod, info in sorted(done.kept.items()):
        bits = info.get("bits")
        out.append(
            ModuleDecision(
                name=mod,
                role=role_of(mod) or "other",
                scheme=f"w{bits}a16" if bits else "kept",
                bits=bits,
                group_size=info.get("group_size"),
                note=f"kept from the {fmt.method} source"
                + ("" if info.get("symmetric", True) else " (asymmetric, zero points)"),
            )
        )
    for mod, info in sorted(done.requantized.items()):
        out.append(
            ModuleDecision(
                name=mod,
                role=role_of(mod) or "other",
                scheme=f"w{info['bits']}a16",
                bits=info["bits"],
                group_size=info["group_size"],
                note="requantized (RTN)",
            )
        )
    return out


@dataclass
class Imported:
    """A quantized checkpoint converted into an artifact folder, before its manifest: the source's record, the module
    decisions (kept and requantized) and what the manifest's `build` says about the conversion."""

    source: SourceInfo
    decisions: list[ModuleDecision]
    build: dict


def import_into(src: ResolvedSource, fmt: QuantFormat, tmp: Path, requantize=None) -> Imported:
    """Convert `src` into the folder `tmp` (the caller's temp folder, renamed into place when complete): its quantized
    tensors repacked, the high-precision weights `requantize(name, shape)` picks rounded (None: all kept), config,
    model files and index written."""
    check_group_order(src.path, fmt)
    info = src.info()
    info.quantization = fmt.summary()
    done = stream_convert(src.path, fmt, tmp, requantize)
    write_config(src.path, tmp, _final_config(src.path, fmt, done))
    copy_model_files(src.path, tmp)
    write_index(tmp)
    log.info(
        "%d quantized modules kept, %d requantized, %d tensors copied",
        len(done.kept),
        len(done.requantized),
        len(done.copied),
    )
    build = {
        "source_format": fmt.summary(),
        "kept": sorted(done.kept),
        "requantized": sorted(done.requantized),
        "copied": sorted(done.copied),
    }
    return Imported(info, _decisions(done, fmt), build)


def write_import(src: ResolvedSource, fmt: QuantFormat, out: Path, force: bool) -> Manifest:
    """The lossless import of `src` into `out`, all or nothing."""
    t0 = time.time()
    with atomic_dir(out, force=force) as tmp:
        imp = import_into(src, fmt, tmp)
        build = {**imp.build, "elapsed_s": round(time.time() - t0, 1)}
        return write_manifest(tmp, imp.source, None, imp.decisions, requires=[], build=build)


def quantized_source(model: str, revision: str | None = None) -> tuple[ResolvedSource, QuantFormat]:
    src = resolve_source(model, revision=revision)
    fmt = detect_format(src.config, where=str(src.path / "config.json"))
    if fmt is None:
        raise QconvError(
            f"{model} is not a quantized checkpoint (no quantization_config)",
            where=str(src.path),
            fix="use `qconv build --model` for a full-precision model",
        )
    return src, fmt


def convert_quantized(model: str, out: Path, *, force: bool = False, revision: str | None = None) -> Manifest:
    """Lossless import of a GPTQ / AWQ / AutoRound / compressed-tensors checkpoint into compressed-tensors."""
    src, fmt = quantized_source(model, revision)
    return write_import(src, fmt, Path(out), force)


def requant_args(recipe: Recipe, notes: dict[str, str]):
    """The build's choice for each still-high-precision weight: QuantizationArgs for weight-only 8-bit group or
    channel schemes (round-to-nearest is near-lossless at 8 bits), None to keep it; a 4-bit or activation scheme
    would need calibration, so such weights are kept and the reason recorded in `notes`."""
    from compressed_tensors.quantization import QuantizationArgs

    from qconv.convert.layout import pick_group

    def choose(name: str, shape: tuple[int, ...]):
        if not name.endswith(".weight") or len(shape) != 2:
            return None
        mod = name[: -len(".weight")]
        role = role_of(mod)
        label = recipe.scheme_for(role) if role else KEEP
        if label == KEEP:
            return None
        s = recipe.schemes[label]
        w = s.weights
        if w.bits != 8 or s.activations is not None or not w.symmetric:
            notes[mod] = f"recipe scheme {label} needs calibration (GPTQ); kept as in the source"
            return None
        k = shape[1]
        g = pick_group(k, w.group_size, recipe.quantizer.group_size_fallback) if w.strategy == "group" else k
        if g is None:
            notes[mod] = f"in_features {k} fits no group size: kept as in the source"
            return None
        return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=g)

    return choose


__all__ = ["convert_quantized", "requant_args", "detect_format"]
