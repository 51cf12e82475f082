"""`qconv build`: source + recipe -> a compressed-tensors artifact folder with its manifest, all or nothing.

Every choice is resolved once into a BuildPlan (build/plan.py) and handed down. The work happens in stages cached in
a work dir (see build/workdir.py, build/stages.py), each keyed by the plan fields it reads and its inputs: a rerun of
a killed build picks up where it stopped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from qconv import compute, progress
from qconv.build import quality_stage, stages
from qconv.build.memplan import budget_for
from qconv.build.options import BuildOptions, check_out, recipe_for, work_root
from qconv.build.plan import BuildPlan
from qconv.build.quantized import build_from_quantized
from qconv.build.workdir import WorkDir
from qconv.calibrate.select import format_table, select
from qconv.convert import patches
from qconv.convert.finish import finalize, write_manifest
from qconv.convert.layout import Layout, apply_selection, layout_model
from qconv.convert.quantized import detect_format
from qconv.convert.requires import requirements
from qconv.convert.sources import resolve_source
from qconv.disk import check_writable, disk_error
from qconv.errors import QconvError
from qconv.fsutil import atomic_dir, owned_temp_dir, sweep_stale
from qconv.manifest import Manifest
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)

__all__ = ["BuildOptions", "build"]


def build(opts: BuildOptions, recipe: Recipe | None = None) -> Manifest:
    """Build the artifact; a full disk or a folder we may not write, wherever it happens, is one QconvError and
    leaves nothing half-written (every write goes to a temp folder that is removed on error). `recipe`: the one
    recipe_for(opts) gave, when the caller has it already."""
    where: dict = {"what": "writing the build's files", "where": opts.out, "needed": None}
    try:
        with contextlib.ExitStack() as held:
            return _build(opts, recipe or recipe_for(opts), held, where)
    except QconvError:
        raise
    except Exception as e:
        if err := disk_error(e, **where):
            raise err from e
        raise


def _build(opts: BuildOptions, recipe: Recipe, held: contextlib.ExitStack, where: dict) -> Manifest:
    import torch
    from transformers import AutoTokenizer

    t0 = time.time()
    patches.check_all()  # a library whose private functions moved stops the build here, before any work
    out = check_out(opts)  # once, before any work: it knows every folder the source and work dir can resolve to
    sweep_stale(out.parent, out.name)  # temp and parked folders a killed build left beside --out
    check_writable(out.parent, "cannot write beside --out")
    src = resolve_source(opts.model, revision=opts.revision)
    if detect_format(src.config, where=str(src.path / "config.json")) is not None:
        return build_from_quantized(opts, recipe, src)  # keeps its quantized tensors, requantizes the rest (no GPU)
    plan = BuildPlan.make(opts, recipe, src, layout_model(src.path, src.config, recipe))  # refuses a missing GPU
    _check(plan)
    work = WorkDir(work_root(opts, src.id), fresh=opts.fresh)
    held.enter_context(work.locked())
    work.clean_partials()
    stages.check_space_for(out, work, plan.layout)
    where.update(what="writing the build's files", where=work.root, needed=plan.layout.total_bytes)
    fresh = " (--fresh: cached stages ignored)" if opts.fresh else ""
    log.info("work dir %s%s", work.root, fresh, extra=progress.log_dir(work.root))
    source_info = stages.source_info(src, work)
    source_info.num_parameters = plan.layout.num_parameters
    torch.manual_seed(plan.seed)
    tok = AutoTokenizer.from_pretrained(src.path)
    with _model_loader(plan, work) as model_loader:
        calib = stages.calibration(plan, source_info.sha256, tok, model_loader, work)
        scores = stages.sensitivity(plan, calib, source_info.sha256, model_loader, work) if plan.scored else None
        selection = select(
            list(plan.units), scores, plan.budget_bytes, budget=plan.budget_label, scheme=recipe.selection.scheme
        )
        modules = apply_selection(plan.layout, list(plan.units), selection.choices)
        if plan.units:
            log.info("%s", format_table(selection))
        qdir = stages.quantization(plan, modules, calib, source_info.sha256, tok, model_loader, work)
    final = replace(plan.layout, modules=modules)
    where.update(what="writing the artifact", where=out.parent)
    log.info("packaging %s", out, extra=progress.stage("packaging"))
    with atomic_dir(out, force=opts.force) as tmp:
        stages.package(src.path, qdir, tmp)
        build = {**_build_record(plan, final, work), "stages": work.record, "elapsed_s": round(time.time() - t0, 1)}
        manifest = write_manifest(
            tmp,
            source_info,
            recipe,
            final.modules,
            requires=requirements(recipe, final, rotated=bool(plan.rotated)),
            build=build,
            calibration=calib.info,
            selection=selection.to_dict(),
            tools=plan.tools,
        )
        gate_error = quality_stage.measure(plan, tmp, manifest, work, final=out)
        manifest.build.stages = work.record
        finalize(tmp, manifest, changed=quality_stage.REPORTS)
    size, source_bytes = manifest.total_size(), plan.layout.source_bytes
    reused = [s for s, r in work.record.items() if r["reused"]]
    log.info(
        "built %s: %.2f GB (source %.2f GB, %.1f%%) in %.0f s%s",
        out,
        size / 1e9,
        source_bytes / 1e9,
        100 * size / max(source_bytes, 1),
        time.time() - t0,
        f"; reused stages: {', '.join(reused)}" if reused else "",
    )
    if gate_error:
        raise gate_error
    return manifest


def _check(plan: BuildPlan) -> None:
    """What the plan cannot do, refused before anything is written: a card too small (a CPU build bounds its own
    memory), a model-level sensitivity on a streamed build, a candidate a streamed build cannot score."""
    for w in plan.layout.warnings:
        log.warning("plan: %s", w)
    if plan.device != "cpu":
        budget = budget_for(plan)
        for line in budget.lines():
            log.info("%s", line)
        budget.check()
    if plan.scored and plan.stream and plan.sensitivity == "kld":
        raise QconvError(
            "--sensitivity kld runs the whole model once per unit: a streamed build cannot",
            where="--sensitivity",
            fix="use --sensitivity proxy (the default) or build in memory",
        )
    if plan.budget_bytes > 0 and plan.stream:
        from qconv.build.streamed_sensitivity import members_by_layer

        members_by_layer(list(plan.units))  # a candidate outside the decoder layers


@contextlib.contextmanager
def _model_loader(plan: BuildPlan, work: WorkDir):
    """A loader of the source model, loaded at most once and only when a stage needs it (a streamed model with this
    build's own offload folder, swept after a crash like any temp folder); freed on exit."""
    box: dict = {}
    with contextlib.ExitStack() as offload:

        def load():
            if "m" not in box:
                if plan.stream:
                    from qconv.convert.stream import load_streamed_model

                    tmp = offload.enter_context(owned_temp_dir(work.root, "qconv-offload"))
                    box["m"] = load_streamed_model(plan.source.path, plan.source.config, tmp / "offload")
                else:
                    from qconv.convert.hfmodel import load_causal_lm

                    box["m"] = load_causal_lm(plan.source.path, config=plan.source.config)
                box["m"].eval()
            return box["m"]

        try:
            yield load
        finally:
            box.clear()


def _build_record(plan: BuildPlan, final: Layout, work: WorkDir) -> dict:
    """What qconv.json's `build` records of the plan and the final layout."""
    return {
        "seed": plan.seed,
        "family": final.family,
        "untied_embeddings": final.untie_embeddings,
        "tied_embeddings": final.tied_embeddings,
        "untie_bytes": final.untie_bytes,
        "estimated_bytes": final.total_bytes,
        "source_bytes": final.source_bytes,
        "warnings": final.warnings,
        "streamed": plan.stream,
        "work_dir": str(work.root),
        "device": plan.device,
        "compute_dtype": compute.dtype_name(plan.compute_dtype),
        "cpu_isa": plan.cpu_isa,
    }
