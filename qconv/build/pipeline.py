"""`qconv build`: source + recipe -> a compressed-tensors artifact folder with its manifest, all or nothing.

The work happens in stages cached in a work dir (see stages.py): a rerun of a killed build picks up where it
stopped, and every input that feeds the weights (source hashes, calibration hash, recipe hash, selection, tool
versions) is in the stage keys and in the manifest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from qconv import progress
from qconv.build.quantized import build_from_quantized
from qconv.calibrate.select import format_table, parse_budget, select
from qconv.calibrate.sensitivity import Scores
from qconv.convert.artifact import copy_mtp, copy_side_files, finalize, write_index
from qconv.convert.layout import Plan, apply_selection, bpw_budget, candidate_units, plan_model
from qconv.convert.quantized import detect_format
from qconv.convert.requires import requirements
from qconv.convert.sources import ResolvedSource, read_config, resolve_source
from qconv.convert.stages import DONE, WorkDir, default_work_dir, stage_key
from qconv.errors import GateFailure, QconvError
from qconv.eval.forward import Forward
from qconv.eval.report import REPORT_JSON, REPORT_MD, REPORT_PNG, render_md
from qconv.eval.report import summary as summary_of
from qconv.eval.run import gate_failure, quality_report
from qconv.fsutil import (atomic_dir, check_out_folder, check_space, check_writable, disk_error, owned_temp_dir,
                          sha256_file, sweep_stale, write_json_atomic, write_text_atomic)
from qconv.kv.plan import int8_headroom
from qconv.manifest import MANIFEST, CalibrationInfo, Manifest, QualityReport, RecipeInfo, SourceInfo, tool_versions
from qconv.paths import qconv_home
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
    budget_bytes: int = 0
    budget_note: str = ""  # how an `auto` budget was found
    units: list = None  # convert.layout.Unit candidates (for the by-role preview without scores)


def _recipe(opts: BuildOptions) -> Recipe:
    recipe = load_recipe(opts.recipe)
    if opts.bpw is not None and opts.int8_budget is not None:
        raise QconvError("--bpw and --int8-budget both set the selection's budget", where="--bpw",
                         fix="pass one of them")
    if opts.int8_budget is not None:
        recipe.selection = replace(recipe.selection, budget=str(opts.int8_budget))
    return recipe


def _budget(opts: BuildOptions, recipe: Recipe, plan: Plan, config: dict) -> tuple[int, str]:
    """The selection budget in bytes and how it was found: a --bpw target, else the recipe's (int8_budget)."""

    if opts.bpw is not None:
        return bpw_budget(opts.bpw, plan), f"INT8 budget from --bpw {opts.bpw:g}"
    return int8_budget(recipe, plan, config)


def _budget_label(opts: BuildOptions, recipe: Recipe) -> str:
    return f"{opts.bpw} bpw" if opts.bpw is not None else recipe.selection.budget


def _work(opts: BuildOptions, src_id: str) -> WorkDir:
    return WorkDir(Path(opts.work_dir) if opts.work_dir else default_work_dir(src_id, opts.revision), fresh=opts.fresh)


def int8_budget(recipe: Recipe, plan: Plan, config: dict) -> tuple[int, str]:
    """The selection budget in bytes, and for `auto` the fit it came from (the KV planner's, see
    qconv.kv.plan.int8_headroom)."""
    spec = recipe.selection.budget
    if spec.strip() != "auto":
        return parse_budget(spec, plan.total_bytes), ""
    roles = plan.bytes_by_role()
    left, fit = int8_headroom(config, recipe, plan.total_bytes, roles.get("vision", {}).get("bytes", 0),
                              roles.get("mtp", {}).get("bytes", 0))
    gib, card = 2**30, recipe.card
    on_card = card.memory_gib * gib * fit.profile.gpu_memory_utilization
    note = (f"INT8 budget auto = {left / gib:.2f} GiB: {card.name} {card.memory_gib:g} GiB x "
            f"{fit.profile.gpu_memory_utilization:g} - reserve {card.reserve_gib:g} GiB - weights "
            f"{(on_card - card.reserve_gib * gib - fit.usable) / gib:.2f} GiB - profile {fit.name} "
            f"({fit.profile.kv_cache} KV at {fit.profile.context_length:,} tokens x {fit.profile.max_num_seqs} "
            f"+ recurrent state) {fit.need / gib:.2f} GiB")
    if (bpw := recipe.selection.max_bpw) is not None and plan.num_parameters:
        cap = max(0, int(bpw * plan.num_parameters / 8) - plan.total_bytes)
        if cap < left:
            note += f"; capped at {cap / gib:.2f} GiB by selection.max_bpw {bpw:g}"
            left = cap
    log.info("%s", note)
    return parse_budget(spec, plan.total_bytes, left), note


def dry_run(opts: BuildOptions) -> DryRun:
    """The plan without loading weights: shapes come from safetensors headers or a meta-device model. When the
    work dir holds sensitivity scores from an earlier build, the INT8 selection they give is shown too."""
    recipe = _recipe(opts)
    src = resolve_source(opts.model, revision=opts.revision, weights=False)
    if opts.out is not None:  # the build's own check: a dry run says what the build will say
        check_out(opts, source=src.path)
    config = read_config(src.path)
    plan = plan_model(src.path, config, recipe)
    selection = None
    budget, note = _budget(opts, recipe, plan, config)
    work_root = Path(opts.work_dir) if opts.work_dir else default_work_dir(src.id, opts.revision)
    cached = WorkDir(work_root).latest("sensitivity") if work_root.is_dir() else None
    units = candidate_units(plan, recipe)
    if cached and set(cached["values"]) >= {u.name for u in units}:
        selection = select(units, Scores(**cached), budget,
                           budget=_budget_label(opts, recipe), scheme=recipe.selection.scheme)
    return DryRun(plan, recipe, config, selection, budget, note, units)


def _source_info(src: ResolvedSource, work: WorkDir) -> SourceInfo:
    """Stage `import`: hashing a 55 GB source takes minutes, so its file hashes are cached by each file's stat.
    Name, size and mtime can all be kept by an edit (`touch -r`, a same-size rewrite); the inode change time and the
    inode cannot, so any rewrite or copy re-hashes."""
    stats = [(p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
             for p in sorted(src.path.iterdir()) if p.is_file() and (st := p.stat())]
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


def _sensitivity(opts, units, calib, src_sha, model_loader, work: WorkDir, streamed_from: Path | None,
                 sens_samples: int = 8):
    """Stage `sensitivity`: per-unit scores, keyed by source sha256 + calibration sha256 + the units' decisions.
    A streamed build (`streamed_from`: the source folder) scores a decoder layer at a time."""
    from qconv.calibrate.sensitivity import model_kld_scores, proxy_scores

    ids = calib.input_ids[:sens_samples]  # a few sequences rank the units; all of them feed GPTQ
    key = stage_key("sensitivity", src_sha, calib.info.sha256, opts.sensitivity, sens_samples,
                    [(u.name, [asdict(m) for m in u.w4], [(o.scheme, [asdict(m) for m in o.members]) for o in u.options])
                     for u in units])
    cached = work.load_json("sensitivity", key)
    if cached:
        return Scores(**cached)
    if streamed_from is not None:
        from qconv.build.streamed_sensitivity import streamed_proxy_scores

        with owned_temp_dir(work.root, "qconv-sensitivity") as spill:
            scores = streamed_proxy_scores(streamed_from, units, ids, spill)
    else:
        fn = model_kld_scores if opts.sensitivity == "kld" else proxy_scores
        scores = fn(model_loader(), units, ids)
    work.save_json("sensitivity", key, asdict(scores))
    return scores


def use_streaming(opts: BuildOptions, plan: Plan) -> bool:
    from qconv.convert.stream import should_stream

    stream = opts.stream if opts.stream is not None else should_stream(plan.source_bytes)
    if stream and (plan.untie_embeddings or plan.tied_embeddings):
        if opts.stream:
            raise QconvError("--stream cannot build tied embeddings (the disk-offloaded lm_head shares the "
                             "embedding's storage)", where="--stream",
                             fix="build this model in memory (drop --stream); tied embeddings come with small models")
        log.warning("tied embeddings: building in memory although RAM is short (streaming cannot tie them)")
        return False
    return stream


def _protected(opts: BuildOptions, work: Path | None = None, source: Path | None = None) -> dict:
    """What --out must neither be, sit inside, nor contain: the user's inputs and qconv's own caches."""
    local = lambda v: Path(v).expanduser() if v and Path(v).expanduser().exists() else None  # noqa: E731
    home = qconv_home()
    return {"source model": local(opts.model), "resolved source": source, "work dir": work or opts.work_dir,
            "work dirs root": home / "work", "reference cache": home / "reference", "GGUF import cache": home / "imports",
            "calibration dataset": local(opts.dataset), "evaluation text": local(opts.eval_text)}


def check_out(opts: BuildOptions, **protected) -> Path:
    """--out refused before any work when it is missing, unsafe to write or to --force (see check_out_folder)."""
    if opts.out is None:
        raise QconvError("no output folder", where="--out", fix="pass --out DIR")
    return check_out_folder(opts.out, force=opts.force, marker=MANIFEST, protected=_protected(opts, **protected))


def build(opts: BuildOptions) -> Manifest:
    """Build the artifact; a full disk or a folder we may not write, wherever it happens, is one QconvError and
    leaves nothing half-written (every write goes to a temp folder that is removed on error)."""
    where: dict = {"what": "writing the build's files", "where": opts.out, "needed": None}
    try:
        with contextlib.ExitStack() as held:
            return _build(opts, held, where)
    except QconvError:
        raise
    except Exception as e:
        if err := disk_error(e, **where):
            raise err from e
        raise


def _build(opts: BuildOptions, held: contextlib.ExitStack, where: dict) -> Manifest:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.quantize import quantize
    from qconv.convert.stream import MAX_SHARD_SIZE, row_blocked_gptq, row_blocked_observer

    t0 = time.time()
    recipe = _recipe(opts)
    out = check_out(opts)
    sweep_stale(out.parent, out.name)  # temp and parked folders a killed build left beside --out
    check_writable(out.parent, "cannot write beside --out")
    src = resolve_source(opts.model, revision=opts.revision)
    check_out(opts, source=src.path)
    config = read_config(src.path)
    if detect_format(config, where=str(src.path / "config.json")) is not None:
        return build_from_quantized(opts, recipe)  # keeps its quantized tensors, requantizes the rest (no GPU)
    plan = plan_model(src.path, config, recipe)
    for w in plan.warnings:
        log.warning("plan: %s", w)
    budget, _ = _budget(opts, recipe, plan, config)
    units = candidate_units(plan, recipe)
    stream = use_streaming(opts, plan)
    if budget > 0 and stream and opts.sensitivity == "kld" and any(not u.refusal for u in units):
        raise QconvError("--sensitivity kld runs the whole model once per unit: a streamed build cannot",
                         where="--sensitivity", fix="use --sensitivity proxy (the default) or build in memory")
    if budget > 0 and stream:
        from qconv.build.streamed_sensitivity import members_by_layer

        members_by_layer(units)  # a candidate outside the decoder layers is refused before anything is written
    work = _work(opts, src.id)
    check_out(opts, source=src.path, work=work.root)
    held.enter_context(work.locked())
    work.clean_partials()
    _check_space(out, work, plan)
    where.update(what="writing the build's files", where=work.root, needed=plan.total_bytes)
    log.info("work dir %s%s", work.root, " (--fresh: cached stages ignored)" if opts.fresh else "",
             extra=progress.log_dir(work.root))
    source_info = _source_info(src, work)
    source_info.num_parameters = plan.num_parameters

    cal = recipe.calibration
    seed = cal.seed if opts.seed is None else opts.seed
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(src.path)
    model_box = {}
    offload = held.enter_context(contextlib.ExitStack())

    def model_loader():
        if "m" not in model_box:
            if stream:  # this build's own offload folder, swept after a crash like any temp folder
                from qconv.convert.stream import load_streamed_model

                tmp = offload.enter_context(owned_temp_dir(work.root, "qconv-offload"))
                model_box["m"] = load_streamed_model(src.path, config, tmp / "offload")
            else:
                model_box["m"] = load_causal_lm(src.path)
            model_box["m"].eval()
        return model_box["m"]

    calib = _calibration(opts, recipe, source_info.sha256, tok, model_loader, work, seed)
    scores = None
    if budget > 0 and any(not u.refusal for u in units):
        scores = _sensitivity(opts, units, calib, source_info.sha256, model_loader, work, src.path if stream else None)
    selection = select(units, scores, budget, budget=_budget_label(opts, recipe), scheme=recipe.selection.scheme)
    modules = apply_selection(plan, units, selection.choices)
    if units:
        log.info("%s", format_table(selection))
    final_plan = replace(plan, modules=modules)

    manifest = Manifest(
        source=source_info,
        recipe=RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict()),
        modules=modules,
        calibration=calib.info,
        profiles=dict(recipe.profiles),
        speculative=recipe.speculative,
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
        with work.new_dir("quantization", qkey) as tmp, row_blocked_gptq(), row_blocked_observer(), \
                tokenizer_as_processor(tok), _calibration_activations(stream, work.root):
            quantize(model_loader(), modules, recipe, calib.input_ids, tmp, untie=plan.untie_embeddings, seed=seed,
                     tied=plan.tied_embeddings)
        qdir = work.root / f"quantization-{qkey}"
    model_box.clear()
    offload.close()
    gate_error = None
    where.update(what="writing the artifact", where=out.parent)
    log.info("packaging %s", out, extra=progress.stage("packaging"))
    with atomic_dir(out, force=opts.force) as tmp:
        _package(src.path, qdir, tmp, GenerationConfig)
        manifest.build.stages = work.record
        manifest.build.elapsed_s = round(time.time() - t0, 1)
        finalize(tmp, manifest)
        gate_error = _quality(opts, recipe, src.path, tmp, manifest, work, final=out, streamed=stream)
        manifest.build.stages = work.record
        finalize(tmp, manifest)
    size = manifest.total_size()
    reused = [s for s, r in work.record.items() if r["reused"]]
    log.info("built %s: %.2f GB (source %.2f GB, %.1f%%) in %.0f s%s", out, size / 1e9, plan.source_bytes / 1e9,
             100 * size / max(plan.source_bytes, 1), time.time() - t0,
             f"; reused stages: {', '.join(reused)}" if reused else "")
    if gate_error:
        raise gate_error
    return manifest


@contextlib.contextmanager
def _calibration_activations(stream: bool, root: Path):
    """A streamed build keeps its calibration activations on disk (bounded memory whatever the sample count), in
    a temp folder of the work dir that a crash leaves for sweeping; an in-memory build keeps them in memory."""
    if not stream:
        yield
        return
    from qconv.convert.stream import activations_on_disk

    with owned_temp_dir(root, "qconv-activations") as tmp, activations_on_disk(tmp):
        log.info("calibration activations are kept on disk under %s", tmp)
        yield


@contextlib.contextmanager
def tokenizer_as_processor(tok):
    """llmcompressor loads the model's AutoProcessor whenever a dataset is passed, although ours is token ids
    already; for a vision-language checkpoint (Qwen3_5ForConditionalGeneration) that processor needs torchvision
    for its video half. Hand it the tokenizer instead. (quantize.quantize passing `processor=` to oneshot would
    make this unnecessary.)"""
    from llmcompressor.entrypoints import utils

    before = utils.initialize_processor_from_path
    utils.initialize_processor_from_path = lambda model_args, model: tok
    try:
        yield
    finally:
        utils.initialize_processor_from_path = before


def _check_space(out: Path, work: WorkDir, plan: Plan) -> None:
    """About the artifact's size goes to the work dir (the quantization stage, unless one is cached) and again to
    --out: refuse before the work when the disks do not hold that."""
    need = {}
    cached = any(p.is_dir() for p in work.root.glob("quantization-*"))
    for folder in (out.parent,) if cached else (work.root, out.parent):
        dev = folder.stat().st_dev
        need[dev] = (folder, need.get(dev, (folder, 0))[1] + plan.total_bytes)
    for folder, n in need.values():
        check_space(folder, n, "the build's files (work dir and --out)")


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
             work: WorkDir, final: Path, streamed: bool = False) -> GateFailure | None:
    """Stage `quality`: measure the quality cost and apply the recipe's gates (eval area). Returns the gate
    failure, if any. Cached by the weight files' hashes and the evaluation settings. `artifact` is the build's
    temp folder; `final` is where it ends up, the path the reports name. A streamed build measures with the
    layer-streamed forward too; otherwise it streams only when a model does not fit in free memory."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning("quality report skipped: no held-out text (pass --eval-text FILE_OR_HF_ID, or set quality.text "
                    "in the recipe); the artifact is marked unchecked")
        return None
    weights = {k: v.sha256 for k, v in manifest.files.items() if k.endswith(".safetensors")}
    text_id = sha256_file(Path(text)) if Path(text).is_file() else text
    key = stage_key("quality", weights, text_id, asdict(recipe.quality), manifest.source.sha256)
    reports = (REPORT_JSON, REPORT_MD, REPORT_PNG)  # part of the artifact: a reused stage puts them back
    qdir = work.cached_dir("quality", key)
    if qdir is None:
        with work.new_dir("quality", key) as tmp:
            quality_report(source, artifact, recipe, text=text, source_sha256=manifest.source.sha256,
                           num_parameters=manifest.source.num_parameters,
                           fwd=Forward(streamed=True if streamed else None))
            _copy_files(artifact, tmp, reports)
    else:
        _copy_files(qdir, artifact, reports)
    _name_final_path(artifact, final)
    summary = summary_of(json.loads((artifact / REPORT_JSON).read_text()))
    predicted = manifest.selection.predicted_kld if manifest.selection else None
    if predicted is not None and summary.get("weights"):
        summary["selection"] = {"method": manifest.selection.method, "predicted_kld": predicted,
                                "measured_kld": summary["weights"]["kld_mean"]}
    manifest.quality = QualityReport.of(summary)
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
    path = artifact / REPORT_JSON
    if path.is_file():
        report = json.loads(path.read_text())
        report["artifact"] = str(Path(final).resolve())
        write_json_atomic(path, report)
        write_text_atomic(artifact / REPORT_MD, render_md(report))
