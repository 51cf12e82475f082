"""Measure an artifact against its source: reference (cached) vs quantized, weights only and weights + KV."""

from __future__ import annotations

import datetime as dt
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qconv.compute import dtype_name
from qconv.errors import QconvError
from qconv.eval.forward import Forward, LogitSource
from qconv.eval.kvsim import get_scheme
from qconv.eval.metrics import TokenStats, summarize
from qconv.eval.record import (
    EvalReport,
    EvalSettings,
    ForwardInfo,
    MeasuredSource,
    MetricSummary,
    ReferenceInfo,
    TextInfo,
)
from qconv.eval.reference import Reference, build_reference, open_cached
from qconv.eval.text import Windows, load_text, make_windows
from qconv.modelfiles import load_tokenizer, safetensors_header

log = logging.getLogger(__name__)


@dataclass
class Source:
    path: Path
    sha256: str
    num_parameters: int
    cache: bool = False  # path is a reference cache folder (log-probs someone computed), not the model itself


def cached_source(path: str | Path, num_parameters: int | None = None) -> Source | None:
    """A reference cache folder given where a reference model is expected, as a Source; None for anything else."""
    from qconv.eval.reference import cache_meta, is_cache

    if not is_cache(path):
        return None
    folder, meta = cache_meta(path)
    n = meta.get("num_parameters") or num_parameters
    if not n:
        raise QconvError(
            "the reference cache records no parameter count (made by an older qconv)",
            where=str(folder),
            fix="recompute it with `qconv eval ARTIFACT --reference MODEL`",
        )
    return Source(path=folder, sha256=meta.get("source_sha256", ""), num_parameters=int(n), cache=True)


def safetensors_stats(folder: str | Path) -> tuple[int, int]:
    """(number of stored elements, bytes of tensor data) over a folder's *.safetensors, read from headers only."""
    numel = nbytes = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        for t in safetensors_header(f).values():
            numel += int(np.prod(t["shape"], dtype=np.int64))
            nbytes += t["data_offsets"][1] - t["data_offsets"][0]
    return numel, nbytes


def resolve_reference(reference: str | Path | None, manifest) -> Source:
    """The source model to compare against: --reference, else the source recorded in the artifact's manifest."""
    from qconv.convert.sources import resolve_source

    cached = cached_source(reference, manifest.source.num_parameters if manifest else None) if reference else None
    if cached:
        return cached
    spec = str(reference) if reference else (manifest.source.id if manifest else None)
    if not spec:
        raise QconvError(
            "no reference model: the artifact's qconv.json names no source",
            where="--reference",
            fix="pass --reference SOURCE (the full-precision model folder, hub id or .gguf)",
        )
    try:
        src = resolve_source(spec, revision=None if reference else manifest.source.revision)
    except QconvError as e:
        raise QconvError(
            f"reference model not available: {e.what}",
            where=f"--reference {spec}",
            fix=e.fix or "pass --reference with the full-precision source model",
        ) from e
    same = manifest is not None and not reference
    sha = manifest.source.sha256 if same and manifest.source.sha256 else src.info().sha256
    nparams = manifest.source.num_parameters if same and manifest.source.num_parameters else 0
    return Source(path=src.path, sha256=sha, num_parameters=nparams or safetensors_stats(src.path)[0])


def _run(
    logit_source: LogitSource, ref: Reference, windows: Windows, kv_scheme=None, a8_roles: tuple[str, ...] = ()
) -> tuple[MetricSummary, np.ndarray]:
    from tqdm.auto import tqdm

    stats = TokenStats()
    n = len(windows.ids)
    desc = f"eval{'+' + kv_scheme.name if kv_scheme else ''}{'+a8' if a8_roles else ''}"
    for i, blocks in tqdm(
        logit_source.logits(windows, list(range(n)), kv_scheme, a8_roles),
        total=n,
        desc=desc,
        unit="window",
        leave=False,
    ):
        ref_i, a = ref.window(i), 0
        for logits, targets in blocks:
            stats.add(ref_i.rows(a, a + len(targets)), logits, targets)
            a += len(targets)
    return summarize(stats), stats.arrays()["kld"]


def measure(
    artifact_dir: str | Path, source: Source, settings: EvalSettings, fwd: Forward | None = None
) -> tuple[EvalReport, dict[str, np.ndarray]]:
    """The report (no verdicts yet) and the per-token KLD arrays by section, for the plot. `fwd` picks the
    device and whole-model or layer-streamed forward (default: streamed when a model does not fit)."""
    t0 = time.time()
    kv = get_scheme(settings.kv, settings.kv_form) if settings.kv else None  # a bad --kv before minutes of reference
    text = load_text(settings.text)
    # a cached reference has no model beside it: the artifact carries the source's tokenizer, and every cached
    # window's token-id hash is checked against what it gives
    tok = load_tokenizer(artifact_dir if source.cache else source.path)
    windows = make_windows(tok, text, window=settings.window, max_tokens=settings.max_tokens, stride=settings.stride)
    fwd = fwd or Forward()
    if source.cache:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(artifact_dir).get_text_config().vocab_size
        ref = open_cached(source.path, windows, text_sha256=text.sha256, vocab_size=vocab, topk=settings.ref_topk)
    else:
        ref_source = LogitSource(source.path, fwd, source.num_parameters, "reference model")
        ref = build_reference(
            source.path,
            windows,
            source_sha256=source.sha256,
            text_sha256=text.sha256,
            topk=settings.ref_topk,
            logit_source=ref_source,
            num_parameters=source.num_parameters,
        )
        ref_source.close()
    art = LogitSource(artifact_dir, fwd, source.num_parameters, "artifact")
    weights, kld_w = _run(art, ref, windows)
    sections, klds = {"weights": weights}, {"weights": kld_w}
    if kv is not None:
        sections["weights_kv"], klds["weights_kv"] = _run(art, ref, windows, kv)
    if settings.a8_roles:
        sections["weights_a8"], klds["weights_a8"] = _run(art, ref, windows, None, settings.a8_roles)
    art.close()
    numel, nbytes = safetensors_stats(artifact_dir)
    report = EvalReport(
        artifact=str(Path(artifact_dir).resolve()),
        source=MeasuredSource(
            path=str(source.path),
            sha256=source.sha256,
            num_parameters=source.num_parameters,
            kind="cached reference log-probs" if source.cache else "model",
        ),
        settings=settings,
        text=TextInfo(
            label=text.label,
            sha256=text.sha256,
            tokens_scored=windows.num_scored,
            windows=len(windows.ids),
            window=windows.window,
            stride=windows.stride,
        ),
        reference=ReferenceInfo(
            storage=ref.storage,
            topk=ref.topk,
            vocab_size=ref.vocab_size,
            describe=ref.describe(),
            cache=str(ref.folder),
            given_as_cache=source.cache,
        ),
        bits_per_weight=8 * nbytes / source.num_parameters,
        artifact_bytes=nbytes,
        kv_scheme=kv.name if kv else None,
        kv_form=kv.form if kv else None,
        forward=ForwardInfo(
            streamed=art.streamed,
            device=art.device,
            compute_dtype=dtype_name(art.dtype),  # bf16 weights; float32 where bf16 is emulated
        ),
        weights=weights,
        weights_kv=sections.get("weights_kv"),
        weights_a8=sections.get("weights_a8"),
        machine=f"{platform.machine()} {torch.get_num_threads()} threads, "
        f"{'cuda ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}",
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        elapsed_s=round(time.time() - t0, 1),
    )
    return report, klds
