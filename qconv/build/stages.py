"""The build's cached stages before quantization (import, calibration, sensitivity) and its packaging: each keyed
by everything that feeds it (see qconv.build.workdir), so a rerun picks up where a killed build stopped."""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from qconv.build.plan import CALIBRATION, QUANTIZATION, SENSITIVITY, BuildPlan
from qconv.build.workdir import DONE, WorkDir, stage_key
from qconv.calibrate.sensitivity import Scores
from qconv.convert.finish import copy_mtp, copy_side_files, write_index
from qconv.convert.layout import Layout
from qconv.convert.sources import ResolvedSource
from qconv.disk import check_space
from qconv.fsutil import owned_temp_dir
from qconv.manifest import CalibrationInfo, SourceInfo

log = logging.getLogger(__name__)


def source_info(src: ResolvedSource, work: WorkDir) -> SourceInfo:
    """Stage `import`: hashing a 55 GB source takes minutes, so its file hashes are cached by each file's stat.
    Name, size and mtime can all be kept by an edit (`touch -r`, a same-size rewrite); the inode change time and the
    inode cannot, so any rewrite or copy re-hashes."""
    stats = [
        (p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        for p in sorted(src.path.iterdir())
        if p.is_file() and (st := p.stat())
    ]
    key = stage_key("import", str(src.path), src.kind, src.id, src.revision, stats)
    cached = work.load_json("import", key)
    if cached:
        return SourceInfo(**cached)
    info = src.info()
    work.save_json("import", key, asdict(info))
    return info


def calibration(plan: BuildPlan, src_sha: str, tok, model_loader, work: WorkDir):
    """Stage `calibration`: token ids, keyed by the source and the plan's calibration fields (its compute dtype:
    what self-generated text is computed in)."""
    from qconv.calibrate.data import CalibSet, load_calibration

    key = plan.key(CALIBRATION, source=src_sha)
    cached = work.load_json(CALIBRATION, key)
    if cached:
        return CalibSet(cached["input_ids"], CalibrationInfo(**cached["info"]))
    calib = load_calibration(
        plan.dataset,
        tok,
        samples=plan.samples,
        seq_len=plan.seq_len,
        seed=plan.seed,
        default_dataset=plan.default_dataset,
        split=plan.split,
        model_loader=model_loader,
        dtype=plan.compute_dtype,
    )
    work.save_json(CALIBRATION, key, {"input_ids": calib.input_ids, "info": asdict(calib.info)})
    return calib


def sensitivity(plan: BuildPlan, calib, src_sha: str, model_loader, work: WorkDir) -> Scores:
    """Stage `sensitivity`: per-unit scores of the plan's candidates, each scored as it will be rounded and turned
    (the plan's rotated modules). A streamed build scores a decoder layer at a time from the source folder."""
    from qconv.calibrate.sensitivity import model_kld_scores, proxy_scores
    from qconv.compute import computing_in
    from qconv.convert.rotation import selection_rotations

    ids = calib.input_ids[: plan.sensitivity_samples]
    key = plan.key(SENSITIVITY, source=src_sha, calibration=calib.info.sha256)
    cached = work.load_json(SENSITIVITY, key)
    if cached:
        return Scores(**cached)
    rotated = selection_rotations(plan.rotated, plan.recipe)
    units = list(plan.units)
    if plan.stream:
        from qconv.build.streamed_sensitivity import streamed_proxy_scores

        with owned_temp_dir(work.root, "qconv-sensitivity") as spill:
            scores = streamed_proxy_scores(
                plan.source.path, units, ids, spill, device=plan.device, dtype=plan.compute_dtype, rotated=rotated
            )
    else:
        fn = model_kld_scores if plan.sensitivity == "kld" else proxy_scores
        with computing_in(model_loader(), plan.compute_dtype) as model:
            scores = fn(model, units, ids, rotated)
    work.save_json(SENSITIVITY, key, asdict(scores))
    return scores


def quantization(plan: BuildPlan, modules: list, calib, src_sha: str, tok, model_loader, work: WorkDir) -> Path:
    """Stage `quantization`: the compressed model folder of the selected `modules`, keyed by them, the source,
    the calibration and the plan's quantization fields. Returns the stage folder."""
    from qconv.convert.device import on_device
    from qconv.convert.quantize import quantize

    key = plan.key(QUANTIZATION, source=src_sha, calibration=calib.info.sha256, modules=modules)
    qdir = work.cached_dir(QUANTIZATION, key)
    if qdir is not None:
        return qdir
    with work.new_dir(QUANTIZATION, key) as tmp:
        model = model_loader()
        names = {mod: name for name, mod in model.named_modules()}  # for the progress bar's note
        with on_device(plan.device, names), _calibration_activations(plan.stream, work.root):
            quantize(
                model,
                modules,
                plan.recipe,
                calib.input_ids,
                tmp,
                untie=plan.untie,
                seed=plan.seed,
                rotated=list(plan.rotated),
                tied=plan.tied,
                tokenizer=tok,
                device=plan.device,
                dtype=plan.compute_dtype,
                max_shard_size=plan.max_shard_size,
            )
        del model, names  # freed with the caller's model holder (a streamed model holds its offload folder until then)
    return work.root / f"{QUANTIZATION}-{key}"


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


def check_space_for(out: Path, work: WorkDir, layout: Layout) -> None:
    """About the artifact's size goes to the work dir (the quantization stage, unless one is cached) and again to
    --out: refuse before the work when the disks do not hold that."""
    need = {}
    cached = any(p.is_dir() for p in work.root.glob("quantization-*"))
    for folder in (out.parent,) if cached else (work.root, out.parent):
        dev = folder.stat().st_dev
        need[dev] = (folder, need.get(dev, (folder, 0))[1] + layout.total_bytes)
    for folder, n in need.values():
        check_space(folder, n, "the build's files (work dir and --out)")


def package(source: Path, qdir: Path, tmp: Path) -> None:
    """Stage `packaging`: the quantized folder + tokenizer, generation config, MTP shard and index."""
    from transformers import GenerationConfig

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
