"""`qconv build`: source + recipe -> a compressed-tensors artifact folder with its manifest, all or nothing.

The work happens in stages cached in a work dir (see build/workdir.py, build/stages.py): a rerun of a killed build
picks up where it stopped, and every input that feeds the weights (source hashes, calibration hash, recipe hash,
selection, tool versions) is in the stage keys and in the manifest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

from qconv import compute, progress
from qconv.build import quality, stages
from qconv.build.budget import budget_label, selection_budget
from qconv.build.memplan import plan_for
from qconv.build.options import BuildOptions, check_out, recipe_for, use_streaming, work_root
from qconv.build.quantized import build_from_quantized
from qconv.build.workdir import WorkDir, stage_key
from qconv.calibrate.select import format_table, select
from qconv.convert import patches
from qconv.convert.artifact import finalize
from qconv.convert.device import key_part, on_device, resolve_device
from qconv.convert.layout import apply_selection, candidate_units, plan_model
from qconv.convert.quantize import rotated_modules
from qconv.convert.quantized import detect_format
from qconv.convert.requires import requirements
from qconv.convert.sources import resolve_source
from qconv.disk import check_writable, disk_error
from qconv.errors import QconvError
from qconv.fsutil import atomic_dir, owned_temp_dir, sweep_stale
from qconv.manifest import Manifest, RecipeInfo, tool_versions
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

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.quantize import quantize
    from qconv.convert.stream import MAX_SHARD_SIZE

    t0 = time.time()
    device = resolve_device(opts.device)  # --device cuda without a GPU: refused before anything is written
    dtype = compute.resolve(opts.compute_dtype, device)
    patches.check_all()  # a library whose private functions moved stops the build here, before any work
    out = check_out(opts)  # once, before any work: it knows every folder the source and work dir can resolve to
    sweep_stale(out.parent, out.name)  # temp and parked folders a killed build left beside --out
    check_writable(out.parent, "cannot write beside --out")
    src = resolve_source(opts.model, revision=opts.revision)
    config = src.config
    if detect_format(config, where=str(src.path / "config.json")) is not None:
        return build_from_quantized(opts, recipe, src)  # keeps its quantized tensors, requantizes the rest (no GPU)
    plan = plan_model(src.path, config, recipe)
    for w in plan.warnings:
        log.warning("plan: %s", w)
    budget, _ = selection_budget(opts, recipe, plan, config)
    units = candidate_units(plan, recipe)
    stream = use_streaming(opts, plan, recipe.quantizer.algorithm)
    if device != "cpu":  # a card too small is refused now, not hours in (a CPU build bounds its own memory)
        dplan = plan_for(opts, recipe, plan, config)
        for line in dplan.lines():
            log.info("%s", line)
        dplan.check()
    if budget > 0 and stream and opts.sensitivity == "kld" and any(not u.refusal for u in units):
        raise QconvError(
            "--sensitivity kld runs the whole model once per unit: a streamed build cannot",
            where="--sensitivity",
            fix="use --sensitivity proxy (the default) or build in memory",
        )
    if budget > 0 and stream:
        from qconv.build.streamed_sensitivity import members_by_layer

        members_by_layer(units)  # a candidate outside the decoder layers is refused before anything is written
    work = WorkDir(work_root(opts, src.id), fresh=opts.fresh)
    held.enter_context(work.locked())
    work.clean_partials()
    stages.check_space_for(out, work, plan)
    where.update(what="writing the build's files", where=work.root, needed=plan.total_bytes)
    log.info(
        "work dir %s%s",
        work.root,
        " (--fresh: cached stages ignored)" if opts.fresh else "",
        extra=progress.log_dir(work.root),
    )
    source_info = stages.source_info(src, work)
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
                model_box["m"] = load_causal_lm(src.path, config=config)
            model_box["m"].eval()
        return model_box["m"]

    calib = stages.calibration(opts, recipe, source_info.sha256, tok, model_loader, work, seed, dtype)
    scores = None
    if budget > 0 and any(not u.refusal for u in units):
        from qconv.convert.rotation import selection_rotations

        rotated = selection_rotations(plan.modules, recipe)
        scores = stages.sensitivity(
            opts, units, calib, source_info.sha256, model_loader, work, src.path if stream else None, rotated, dtype=dtype
        )
    selection = select(units, scores, budget, budget=budget_label(opts, recipe), scheme=recipe.selection.scheme)
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
        requires=requirements(recipe, final_plan, rotated=bool(rotated_modules(final_plan.modules, recipe))),
        selection=selection.to_dict(),
        tools=tool_versions(),
        status="unchecked",
        build={
            "seed": seed,
            "family": plan.family,
            "untied_embeddings": plan.untie_embeddings,
            "tied_embeddings": plan.tied_embeddings,
            "untie_bytes": plan.untie_bytes,
            "estimated_bytes": final_plan.total_bytes,
            "source_bytes": plan.source_bytes,
            "warnings": plan.warnings,
            "streamed": stream,
            "work_dir": str(work.root),
            "device": device,
            "compute_dtype": compute.dtype_name(dtype),
            "cpu_isa": torch.backends.cpu.get_cpu_capability() if device == "cpu" else None,
        },
    )
    qkey = stage_key(
        "quantization",
        source_info.sha256,
        calib.info.sha256,
        [asdict(m) for m in modules],
        asdict(recipe.quantizer),
        {k: asdict(v) for k, v in recipe.schemes.items()},
        seed,
        plan.untie_embeddings,
        plan.tied_embeddings,
        recipe.tied_embeddings,
        manifest.tools,
        MAX_SHARD_SIZE,
        *key_part(device),
        str(dtype),
    )
    qdir = work.cached_dir("quantization", qkey)
    if qdir is None:
        with work.new_dir("quantization", qkey) as tmp:
            model = model_loader()
            names = {mod: name for name, mod in model.named_modules()}  # for the progress bar's note
            with on_device(device, names), _calibration_activations(stream, work.root):
                quantize(
                    model,
                    modules,
                    recipe,
                    calib.input_ids,
                    tmp,
                    untie=plan.untie_embeddings,
                    seed=seed,
                    tied=plan.tied_embeddings,
                    tokenizer=tok,
                    device=device,
                    dtype=dtype,
                )
            del model, names  # freed with model_box below (a streamed model holds its offload folder until then)
        qdir = work.root / f"quantization-{qkey}"
    model_box.clear()
    offload.close()
    gate_error = None
    where.update(what="writing the artifact", where=out.parent)
    log.info("packaging %s", out, extra=progress.stage("packaging"))
    with atomic_dir(out, force=opts.force) as tmp:
        stages.package(src.path, qdir, tmp)
        manifest.build.stages = work.record
        manifest.build.elapsed_s = round(time.time() - t0, 1)
        finalize(tmp, manifest)
        gate_error = quality.measure(opts, recipe, src.path, tmp, manifest, work, final=out, streamed=stream)
        manifest.build.stages = work.record
        finalize(tmp, manifest, changed=quality.REPORTS)
    size = manifest.total_size()
    reused = [s for s, r in work.record.items() if r["reused"]]
    log.info(
        "built %s: %.2f GB (source %.2f GB, %.1f%%) in %.0f s%s",
        out,
        size / 1e9,
        plan.source_bytes / 1e9,
        100 * size / max(plan.source_bytes, 1),
        time.time() - t0,
        f"; reused stages: {', '.join(reused)}" if reused else "",
    )
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
