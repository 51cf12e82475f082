"""The build's cached stages before quantization (import, calibration, sensitivity) and its packaging: each keyed
by everything that feeds it (see qconv.build.workdir), so a rerun picks up where a killed build stopped."""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from qconv.build.workdir import DONE, WorkDir, stage_key
from qconv.calibrate.sensitivity import Scores
from qconv.convert.artifact import copy_mtp, copy_side_files, write_index
from qconv.convert.layout import Plan
from qconv.convert.sources import ResolvedSource
from qconv.disk import check_space
from qconv.fsutil import owned_temp_dir, sha256_file
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


def calibration(opts, recipe, src_sha, tok, model_loader, work: WorkDir, seed: int, dtype):
    """Stage `calibration`: token ids, keyed by the source and everything that picks them (`dtype`: what
    self-generated text is computed in)."""
    from qconv.calibrate.data import CalibSet, load_calibration

    cal = recipe.calibration
    dataset = opts.dataset or cal.dataset
    samples, seq_len = opts.samples or cal.samples, opts.seq_len or cal.seq_len
    file_sha = sha256_file(Path(dataset).expanduser()) if dataset and Path(dataset).expanduser().is_file() else None
    key = stage_key(
        "calibration", src_sha, dataset, file_sha, samples, seq_len, seed, cal.default_dataset, cal.split, str(dtype)
    )
    cached = work.load_json("calibration", key)
    if cached:
        return CalibSet(cached["input_ids"], CalibrationInfo(**cached["info"]))
    calib = load_calibration(
        dataset,
        tok,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        default_dataset=cal.default_dataset,
        split=cal.split,
        model_loader=model_loader,
        dtype=dtype,
    )
    work.save_json("calibration", key, {"input_ids": calib.input_ids, "info": asdict(calib.info)})
    return calib


def sensitivity(
    opts,
    units,
    calib,
    src_sha,
    model_loader,
    work: WorkDir,
    streamed_from: Path | None,
    rotated: dict | None = None,
    sens_samples: int = 8,
    dtype=None,
) -> Scores:
    """Stage `sensitivity`: per-unit scores, keyed by source sha256 + calibration sha256 + the units' decisions and
    their input rotations (`rotated`: module name -> block; each unit is scored as it will be rounded, turned).
    A streamed build (`streamed_from`: the source folder) scores a decoder layer at a time."""
    from qconv.calibrate.sensitivity import model_kld_scores, proxy_scores
    from qconv.compute import computing_in, resolve
    from qconv.convert.device import key_part, resolve_device

    ids = calib.input_ids[:sens_samples]  # a few sequences rank the units; all of them feed GPTQ
    device = resolve_device(opts.device)
    dtype = dtype or resolve(opts.compute_dtype, device)  # float32 where bf16 is emulated: its backward is far slower
    key = stage_key(
        "sensitivity",
        src_sha,
        calib.info.sha256,
        opts.sensitivity,
        sens_samples,
        [
            (u.name, [asdict(m) for m in u.base], [(o.scheme, [asdict(m) for m in o.members]) for o in u.options])
            for u in units
        ],
        *key_part(device),
        str(dtype),
        sorted((n, b.shape[0], float(b.double().sum())) for n, b in (rotated or {}).items()),
    )
    cached = work.load_json("sensitivity", key)
    if cached:
        return Scores(**cached)
    if streamed_from is not None:
        from qconv.build.streamed_sensitivity import streamed_proxy_scores

        with owned_temp_dir(work.root, "qconv-sensitivity") as spill:
            scores = streamed_proxy_scores(
                streamed_from, units, ids, spill, device=device, dtype=dtype, rotated=rotated
            )
    else:
        fn = model_kld_scores if opts.sensitivity == "kld" else proxy_scores
        with computing_in(model_loader(), dtype) as model:
            scores = fn(model, units, ids, rotated)
    work.save_json("sensitivity", key, asdict(scores))
    return scores


def check_space_for(out: Path, work: WorkDir, plan: Plan) -> None:
    """About the artifact's size goes to the work dir (the quantization stage, unless one is cached) and again to
    --out: refuse before the work when the disks do not hold that."""
    need = {}
    cached = any(p.is_dir() for p in work.root.glob("quantization-*"))
    for folder in (out.parent,) if cached else (work.root, out.parent):
        dev = folder.stat().st_dev
        need[dev] = (folder, need.get(dev, (folder, 0))[1] + plan.total_bytes)
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
