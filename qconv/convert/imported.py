"""Artifacts made from an already-quantized checkpoint: `qconv convert quantized` (a lossless import) and `qconv build`
on a quantized source (the import plus the recipe applied to what is still high precision: RTN, no calibration
forward, no GPU, one tensor in memory at a time). Both write a qconv.json that names the source format and which
tensors were kept and which requantized."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from qconv.convert.artifact import finalize, write_index
from qconv.convert.quantized import (Converted, QuantFormat, copy_model_files, detect_format, quantization_config,
                                     quantization_config_of, stream_convert, write_config)
from qconv.convert.sources import ResolvedSource, read_config, resolve_source
from qconv.errors import QconvError
from qconv.fsutil import atomic_dir
from qconv.manifest import Manifest, ModuleDecision, QualityReport, RecipeInfo, tool_versions
from qconv.recipes.recipe import KEEP, Recipe, Speculative
from qconv.recipes.roles import role_of

log = logging.getLogger(__name__)

IMPORT_RECIPE = "import"  # recipe name recorded for a plain `convert quantized`


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
        out.append(ModuleDecision(name=mod, role=role_of(mod) or "other", scheme=f"w{bits}a16" if bits else "kept",
                                  bits=bits, group_size=info.get("group_size"),
                                  note=f"kept from the {fmt.method} source" + (
                                      "" if info.get("symmetric", True) else " (asymmetric, zero points)")))
    for mod, info in sorted(done.requantized.items()):
        out.append(ModuleDecision(name=mod, role=role_of(mod) or "other", scheme=f"w{info['bits']}a16",
                                  bits=info["bits"], group_size=info["group_size"], note="requantized (RTN)"))
    return out


def _write(src: ResolvedSource, fmt: QuantFormat, out: Path, force: bool, recipe: RecipeInfo, requantize,
           extra_build: dict, quality=None, profiles: dict | None = None, speculative: Speculative | None = None,
           requires=None) -> Manifest:
    """Convert into a temp folder that becomes `out` only when complete. `requires(decisions)` lists what the
    artifact needs at run time; `quality(tmp, manifest)` measures it and returns the gate failure, raised once the
    artifact (marked failed) is in place."""
    t0 = time.time()
    info = src.info()
    info.quantization = fmt.summary()
    with atomic_dir(out, force=force) as tmp:
        done = stream_convert(src.path, fmt, tmp, requantize)
        write_config(src.path, tmp, _final_config(src.path, fmt, done))
        copy_model_files(src.path, tmp)
        write_index(tmp)
        decisions = _decisions(done, fmt)
        manifest = Manifest(source=info, recipe=recipe, modules=decisions, profiles=profiles or {},
                            speculative=speculative, requires=requires(decisions) if requires else [],
                            tools=tool_versions(),
                            status="unchecked",
                            build={"source_format": fmt.summary(), "kept": sorted(done.kept),
                                   "requantized": sorted(done.requantized), "copied": sorted(done.copied),
                                   "elapsed_s": round(time.time() - t0, 1), **extra_build})
        finalize(tmp, manifest)
        gate_error = quality(tmp, manifest, Path(out)) if quality is not None else None
        finalize(tmp, manifest)
    if gate_error is not None:
        raise gate_error
    log.info("%s: %d quantized modules kept, %d requantized, %d tensors copied", out, len(done.kept),
             len(done.requantized), len(done.copied))
    return manifest


def _quantized_source(model: str, revision: str | None = None) -> tuple[ResolvedSource, QuantFormat]:
    src = resolve_source(model, revision=revision)
    fmt = detect_format(read_config(src.path), where=str(src.path / "config.json"))
    if fmt is None:
        raise QconvError(f"{model} is not a quantized checkpoint (no quantization_config)", where=str(src.path),
                         fix="use `qconv build --model` for a full-precision model")
    return src, fmt


def convert_quantized(model: str, out: Path, *, force: bool = False, revision: str | None = None) -> Manifest:
    """Lossless import of a GPTQ / AWQ / AutoRound / compressed-tensors checkpoint into compressed-tensors."""
    src, fmt = _quantized_source(model, revision)
    return _write(src, fmt, Path(out), force, RecipeInfo(name=IMPORT_RECIPE, sha256="", resolved={}), None, {})


def requant_args(recipe: Recipe, notes: dict[str, str]):
    """The build's choice for each still-high-precision weight: QuantizationArgs for weight-only 8-bit group or
    channel schemes (round-to-nearest is near-lossless at 8 bits), None to keep it; a 4-bit or activation scheme
    would need calibration, so such weights are kept and the reason recorded in `notes`."""
    from compressed_tensors.quantization import QuantizationArgs

    from qconv.convert.layout import _pick_group

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
        g = _pick_group(k, w.group_size, recipe.quantizer.group_size_fallback) if w.strategy == "group" else k
        if g is None:
            notes[mod] = f"in_features {k} fits no group size: kept as in the source"
            return None
        return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=g)

    return choose


def build_from_quantized(opts, recipe: Recipe) -> Manifest:
    """`qconv build` on a quantized checkpoint (called by build.build): keep its quantized tensors, requantize what
    the recipe asks of the rest, measure against `opts.reference` (the true original) or else the source itself."""
    from qconv.convert.layout import Plan
    from qconv.convert.requires import requirements
    from qconv.recipes.roles import family_of

    src, fmt = _quantized_source(opts.model, opts.revision)
    notes: dict[str, str] = {}
    reference = getattr(opts, "reference", None)
    family = family_of(read_config(src.path))

    def quality(tmp: Path, manifest: Manifest, final: Path):
        return _quality_vs(opts, recipe, src, fmt, reference, tmp, manifest, final)

    def requires(decisions):
        return requirements(recipe, Plan(family=family, modules=decisions, other_bytes=0, source_bytes=0))

    m = _write(src, fmt, Path(opts.out), opts.force,
               RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict()),
               requant_args(recipe, notes), {"notes": notes, "streamed": True, "reference": reference},
               quality=quality, profiles=dict(recipe.profiles),
               speculative=recipe.speculative, requires=requires)
    return m


def _quality_vs(opts, recipe, src, fmt, reference, artifact: Path, manifest: Manifest, final: Path):
    """Quality report against the bf16 original when given, else against the source checkpoint (its lossless
    import, which our runtime reads), and the report says which."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning("quality report skipped: no held-out text (--eval-text); the artifact is marked unchecked")
        manifest.build["quality_reference"] = None
        return None
    import json
    import tempfile

    from qconv.eval import quality_report
    from qconv.eval.report import REPORT_JSON, REPORT_MD, render_md
    from qconv.fsutil import write_json_atomic, write_text_atomic

    with tempfile.TemporaryDirectory(dir=artifact.parent, prefix=".qconv-ref-") as tmpd:
        if reference:
            ref, kind = Path(reference), "original"
            if fmt.layout != "compressed-tensors" and detect_format(read_config(ref)) is not None:
                raise QconvError(f"--reference {reference} is itself quantized", where="--reference",
                                 fix="pass the full-precision model the checkpoint was made from")
        elif fmt.layout == "compressed-tensors":
            ref, kind = src.path, "source checkpoint"
        else:
            ref, kind = Path(tmpd) / "source", "source checkpoint"
            _write(src, fmt, ref, True, RecipeInfo(name=IMPORT_RECIPE, sha256="", resolved={}), None, {})
        summary = quality_report(ref, artifact, recipe, text=text, num_parameters=manifest.source.num_parameters
                                 or None)
    note = ("against the true original model " + str(reference)) if kind == "original" else (
        "against the quantized checkpoint it started from (no --reference): the numbers measure only what this "
        "build changed, not the loss against the original full-precision model")
    path = artifact / REPORT_JSON
    report = json.loads(path.read_text())
    report["artifact"] = str(final.resolve())
    report["reference_model"] = {"kind": kind, "path": str(reference or src.path), "note": note}
    write_json_atomic(path, report)
    md = render_md(report)
    write_text_atomic(artifact / REPORT_MD, f"Reference: {note}.\n\n" + md)
    summary["reference"] = kind
    manifest.quality = QualityReport(summary)
    passed = summary.get("passed")
    manifest.status = "ok" if passed else ("failed" if passed is False else "unchecked")
    manifest.build["quality_reference"] = {"kind": kind, "note": note}
    if passed is False and opts.gates:
        from qconv.eval.run import gate_failure

        return gate_failure(summary)
    return None


__all__ = ["convert_quantized", "build_from_quantized", "requant_args", "detect_format"]
