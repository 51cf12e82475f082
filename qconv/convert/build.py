"""`qconv build`: source + recipe -> a compressed-tensors artifact folder with its manifest, all or nothing.

The work happens in stages cached in a work dir (see stages.py): a rerun of a killed build picks up where it
stopped, and every input that feeds the weights (source hashes, calibration hash, recipe hash, selection, tool
versions) is in the stage keys and in the manifest.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from qconv.convert.artifact import copy_mtp, copy_side_files, finalize, write_index
from qconv.convert.layout import Plan, plan_model
from qconv.convert.quantized import detect_format
from qconv.convert.requires import requirements
from qconv.convert.sources import ResolvedSource, read_config, resolve_source
from qconv.convert.stages import DONE, WorkDir, default_work_dir, stage_key
from qconv.errors import GateFailure, QconvError
from qconv.fsutil import atomic_dir, sha256_file, write_json_atomic, write_text_atomic
from qconv.manifest import CalibrationInfo, Manifest, RecipeInfo, SourceInfo, tool_versions
from qconv.recipes.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    model: str
    recipe: str = "3090"
    out: Path | None = None
    dataset: str | None = None
    samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    revision: str | None = None
    force: bool = False
    gates: bool = True
    eval_text: str | None = None
    work_dir: Path | None = None  # default: QCONV_HOME/work/<hash of the source>
    fresh: bool = False  # ignore cached stages
    stream: bool | None = None  # None: stream when the model is large against free RAM
    int8_budget: str | None = None  # overrides the recipe's selection.budget
    bpw: float | None = None  # a bits-per-weight target: the INT8 budget is what it leaves over the uniform plan
    sensitivity: str = "proxy"  # "proxy" (per-layer, cheap) | "kld" (model-level, one forward per unit)
    reference: str | None = None  # quantized --model: the full-precision original for the quality report


@dataclass
class DryRun:
    plan: Plan
    recipe: Recipe
    config: dict
    selection: object | None = None  # calibrate.select.Selection when scores are cached in the work dir


def _recipe(opts: BuildOptions) -> Recipe:
    recipe = load_recipe(opts.recipe)
    if opts.bpw is not None and opts.int8_budget is not None:
        raise QconvError("--bpw and --int8-budget both set the selection's budget", where="--bpw",
                         fix="pass one of them")
    if opts.int8_budget is not None:
        recipe.selection = replace(recipe.selection, budget=str(opts.int8_budget))
    return recipe


def _budget(opts: BuildOptions, recipe: Recipe, plan: Plan) -> int:
    from qconv.calibrate.select import bpw_budget, parse_budget

    return bpw_budget(opts.bpw, plan) if opts.bpw is not None else parse_budget(recipe.selection.budget, plan.total_bytes)


def _budget_label(opts: BuildOptions, recipe: Recipe) -> str:
    return f"{opts.bpw} bpw" if opts.bpw is not None else recipe.selection.budget


def _work(opts: BuildOptions, src_id: str) -> WorkDir:
    return WorkDir(Path(opts.work_dir) if opts.work_dir else default_work_dir(src_id, opts.revision), fresh=opts.fresh)


def dry_run(opts: BuildOptions) -> DryRun:
    """The plan without loading weights: shapes come from safetensors headers or a meta-device model. When the
    work dir holds sensitivity scores from an earlier build, the INT8 selection they give is shown too."""
    from qconv.calibrate.select import candidate_units, select
    from qconv.calibrate.sensitivity import Scores

    recipe = _recipe(opts)
    src = resolve_source(opts.model, revision=opts.revision, weights=False)
    config = read_config(src.path)
    plan = plan_model(src.path, config, recipe)
    selection = None
    budget = _budget(opts, recipe, plan)
    work_root = Path(opts.work_dir) if opts.work_dir else default_work_dir(src.id, opts.revision)
    cached = WorkDir(work_root).latest("sensitivity") if work_root.is_dir() else None
    units = candidate_units(plan, recipe)
    if cached and set(cached["values"]) >= {u.name for u in units}:
        selection = select(units, Scores(cached["method"], cached["values"], cached["tokens"]), budget,
                           budget=_budget_label(opts, recipe), scheme=recipe.selection.scheme)
    return DryRun(plan, recipe, config, selection)


def _source_info(src: ResolvedSource, work: WorkDir) -> SourceInfo:
    """Stage `import`: hashing a 55 GB source takes minutes, so its file hashes are cached by name/size/mtime."""
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(src.path.iterdir()) if p.is_file()]
    key = stage_key("import", str(src.path), src.kind, src.id, src.revision, stats)
    cached = work.load_json("import", key)
    if cached:
        return SourceInfo(**cached)
    info = src.info()
    work.save_json("import", key, asdict(info))
    return info


def _calibration(opts, recipe, src_sha, tok, model_loader, work: WorkDir, seed: int):
    """Stage `calibration`: token ids, keyed by the source and everything that picks them."""
    from qconv.calibrate.data import CalibSet, load_calibration

    cal = recipe.calibration
    dataset = opts.dataset or cal.dataset
    samples, seq_len = opts.samples or cal.samples, opts.seq_len or cal.seq_len
    file_sha = sha256_file(Path(dataset).expanduser()) if dataset and Path(dataset).expanduser().is_file() else None
    key = stage_key("calibration", src_sha, dataset, file_sha, samples, seq_len, seed, cal.default_dataset, cal.split)
    cached = work.load_json("calibration", key)
    if cached:
        return CalibSet(cached["input_ids"], CalibrationInfo(**cached["info"]))
    calib = load_calibration(dataset, tok, samples=samples, seq_len=seq_len, seed=seed,
                             default_dataset=cal.default_dataset, split=cal.split, model_loader=model_loader)
    work.save_json("calibration", key, {"input_ids": calib.input_ids, "info": asdict(calib.info)})
    return calib


def _sensitivity(opts, units, calib, src_sha, model_loader, work: WorkDir, sens_samples: int = 8):
    """Stage `sensitivity`: per-unit scores, keyed by source sha256 + calibration sha256 + the units' decisions."""
    from qconv.calibrate.sensitivity import Scores, model_kld_scores, proxy_scores

    ids = calib.input_ids[:sens_samples]  # a few sequences rank the units; all of them feed GPTQ
    key = stage_key("sensitivity", src_sha, calib.info.sha256, opts.sensitivity, sens_samples,
                    [(u.name, [asdict(m) for m in u.w4], [asdict(m) for m in u.w8]) for u in units])
    cached = work.load_json("sensitivity", key)
    if cached:
        return Scores(cached["method"], cached["values"], cached["tokens"])
    model = model_loader()
    fn = model_kld_scores if opts.sensitivity == "kld" else proxy_scores
    scores = fn(model, units, ids)
    work.save_json("sensitivity", key, asdict(scores))
    return scores


def use_streaming(opts: BuildOptions, plan: Plan) -> bool:
    from qconv.convert.stream import should_stream

    stream = opts.stream if opts.stream is not None else should_stream(plan.source_bytes)
    if stream and plan.untie_embeddings:
        if opts.stream:
            raise QconvError("--stream cannot untie tied embeddings (the disk-offloaded lm_head shares the "
                             "embedding's storage)", where="--stream",
                             fix="build this model in memory (drop --stream); tied embeddings come with small models")
        log.warning("tied embeddings: building in memory although RAM is short (streaming cannot untie them)")
        return False
    return stream


def build(opts: BuildOptions) -> Manifest:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from qconv.calibrate.select import apply_selection, candidate_units, format_table, select
    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.quantize import quantize
    from qconv.convert.stream import MAX_SHARD_SIZE, row_blocked_gptq

    t0 = time.time()
    recipe = _recipe(opts)
    if opts.out is None:
        raise QconvError("no output folder", where="--out", fix="pass --out DIR")
    out = Path(opts.out)
    if out.exists() and not opts.force:
        raise QconvError(f"output folder already exists: {out}", where="--out",
                         fix="pass --force to replace it, or choose another --out")
    src = resolve_source(opts.model, revision=opts.revision)
    config = read_config(src.path)
    if detect_format(config, where=str(src.path / "config.json")) is not None:
        from qconv.convert.imported import build_from_quantized

        return build_from_quantized(opts, recipe)  # keeps its quantized tensors, requantizes the rest (no GPU)
    plan = plan_model(src.path, config, recipe)
    for w in plan.warnings:
        log.warning("plan: %s", w)
    budget = _budget(opts, recipe, plan)
    units = candidate_units(plan, recipe)
    stream = use_streaming(opts, plan)
    if budget > 0 and stream and any(not u.refusal for u in units):
        raise QconvError("INT8 selection is not RAM-bounded yet: its sensitivity pass (forward + backward) would "
                         "hold every layer of a streamed model", where="--int8-budget / selection.budget",
                         fix="stream with budget 0 (uniform W4), or build in memory where the model fits")
    work = _work(opts, src.id)
    work.clean_partials()
    log.info("work dir %s%s", work.root, " (--fresh: cached stages ignored)" if opts.fresh else "")
    source_info = _source_info(src, work)
    source_info.num_parameters = plan.num_parameters

    cal = recipe.calibration
    seed = cal.seed if opts.seed is None else opts.seed
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(src.path)
    model_box = {}

    def model_loader():
        if "m" not in model_box:
            if stream:
                from qconv.convert.stream import load_streamed_model

                model_box["m"] = load_streamed_model(src.path, config, work.root / "offload")
            else:
                model_box["m"] = load_causal_lm(src.path)
            model_box["m"].eval()
        return model_box["m"]

    calib = _calibration(opts, recipe, source_info.sha256, tok, model_loader, work, seed)
    scores = None
    if budget > 0 and any(not u.refusal for u in units):
        scores = _sensitivity(opts, units, calib, source_info.sha256, model_loader, work)
    selection = select(units, scores, budget, budget=_budget_label(opts, recipe), scheme=recipe.selection.scheme)
    modules = apply_selection(plan, units, selection)
    if units:
        log.info("%s", format_table(selection))
    final_plan = replace(plan, modules=modules)

    manifest = Manifest(
        source=source_info,
        recipe=RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict()),
        modules=modules,
        calibration=calib.info,
        profiles={k: asdict(v) for k, v in recipe.profiles.items()},
        speculative=asdict(recipe.speculative),
        requires=requirements(recipe, final_plan),
        selection=selection.to_dict(),
        tools=tool_versions(),
        status="unchecked",
        build={"seed": seed, "family": plan.family, "untied_embeddings": plan.untie_embeddings,
               "tied_embeddings": plan.tied_embeddings, "untie_bytes": plan.untie_bytes,
               "estimated_bytes": final_plan.total_bytes, "source_bytes": plan.source_bytes,
               "warnings": plan.warnings, "streamed": stream, "work_dir": str(work.root)},
    )
    qkey = stage_key("quantization", source_info.sha256, calib.info.sha256, [asdict(m) for m in modules],
                     asdict(recipe.quantizer), {k: asdict(v) for k, v in recipe.schemes.items()}, seed,
                     plan.untie_embeddings, plan.tied_embeddings, recipe.tied_embeddings, manifest.tools, MAX_SHARD_SIZE)
    qdir = work.cached_dir("quantization", qkey)
    if qdir is None:
        with work.new_dir("quantization", qkey) as tmp, row_blocked_gptq():
            quantize(model_loader(), modules, recipe, calib.input_ids, tmp, untie=plan.untie_embeddings, seed=seed,
                     tied=plan.tied_embeddings)
        qdir = work.root / f"quantization-{qkey}"
    model_box.clear()
    shutil.rmtree(work.root / "offload", ignore_errors=True)
    gate_error = None
    with atomic_dir(out, force=opts.force) as tmp:
        _package(src.path, qdir, tmp, GenerationConfig)
        manifest.build["stages"] = work.record
        manifest.build["elapsed_s"] = round(time.time() - t0, 1)
        finalize(tmp, manifest)
        gate_error = _quality(opts, recipe, src.path, tmp, manifest, work, final=out)
        manifest.build["stages"] = work.record
        finalize(tmp, manifest)
    size = manifest.total_size()
    reused = [s for s, r in work.record.items() if r["reused"]]
    log.info("built %s: %.2f GB (source %.2f GB, %.1f%%) in %.0f s%s", out, size / 1e9, plan.source_bytes / 1e9,
             100 * size / max(plan.source_bytes, 1), time.time() - t0,
             f"; reused stages: {', '.join(reused)}" if reused else "")
    if gate_error:
        raise gate_error
    return manifest


def _package(source: Path, qdir: Path, tmp: Path, GenerationConfig) -> None:
    """Stage `packaging`: the quantized folder + tokenizer, generation config, MTP shard and index."""
    for p in sorted(qdir.iterdir()):
        if p.is_file() and p.name != DONE:
            shutil.copy2(p, tmp / p.name)
    copy_side_files(source, tmp)
    if (source / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(source).save_pretrained(tmp)
    n_mtp = copy_mtp(source, tmp)
    if n_mtp:
        log.info("kept %d mtp.* tensors (bf16, in `ignore`) for MTP speculation", n_mtp)
    write_index(tmp)


def _quality(opts: BuildOptions, recipe: Recipe, source: Path, artifact: Path, manifest: Manifest,
             work: WorkDir, final: Path) -> GateFailure | None:
    """Stage `quality`: measure the quality cost and apply the recipe's gates (eval area). Returns the gate
    failure, if any. Cached by the weight files' hashes and the evaluation settings. `artifact` is the build's
    temp folder; `final` is where it ends up, the path the reports name."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning("quality report skipped: no held-out text (pass --eval-text FILE_OR_HF_ID, or set quality.text "
                    "in the recipe); the artifact is marked unchecked")
        return None
    try:
        from qconv.eval import quality_report
        from qconv.eval.report import REPORT_JSON, REPORT_MD, REPORT_PNG
        from qconv.eval.report import summary as summary_of
        from qconv.eval.run import gate_failure
    except ImportError:
        log.warning("quality report skipped: qconv.eval is not available in this install")
        return None
    weights = {k: v["sha256"] for k, v in manifest.files.items() if k.endswith(".safetensors")}
    text_id = sha256_file(Path(text)) if Path(text).is_file() else text
    key = stage_key("quality", weights, text_id, asdict(recipe.quality), manifest.source.sha256)
    reports = (REPORT_JSON, REPORT_MD, REPORT_PNG)  # part of the artifact: a reused stage puts them back
    qdir = work.cached_dir("quality", key)
    if qdir is None:
        with work.new_dir("quality", key) as tmp:
            quality_report(source, artifact, recipe, text=text, source_sha256=manifest.source.sha256,
                           num_parameters=manifest.source.num_parameters)
            _copy_files(artifact, tmp, reports)
    else:
        _copy_files(qdir, artifact, reports)
    _name_final_path(artifact, final)
    summary = summary_of(json.loads((artifact / REPORT_JSON).read_text()))
    manifest.quality = summary
    passed = summary.get("passed")
    manifest.status = "ok" if passed else ("failed" if passed is False else "unchecked")
    if passed is False and opts.gates:
        return gate_failure(summary)
    return None


def _copy_files(src: Path, dst: Path, names) -> None:
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _name_final_path(artifact: Path, final: Path) -> None:
    """The reports are written inside the build's temp folder (atomic_dir) and would name it; point them at the
    folder the artifact is renamed to."""
    from qconv.eval.report import REPORT_JSON, REPORT_MD, render_md

    path = artifact / REPORT_JSON
    if path.is_file():
        report = json.loads(path.read_text())
        report["artifact"] = str(Path(final).resolve())
        write_json_atomic(path, report)
        write_text_atomic(artifact / REPORT_MD, render_md(report))
