"""`qconv build`: source + recipe -> a compressed-tensors artifact folder with its manifest, all or nothing."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qconv.convert.artifact import copy_mtp, copy_side_files, finalize, write_index
from qconv.convert.layout import Plan, plan_model
from qconv.convert.sources import read_config, resolve_source
from qconv.errors import GateFailure, QconvError
from qconv.fsutil import atomic_dir
from qconv.manifest import Manifest, RecipeInfo, tool_versions
from qconv.recipes.recipe import KEEP, Recipe, load_recipe

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


@dataclass
class DryRun:
    plan: Plan
    recipe: Recipe
    config: dict


def requirements(recipe: Recipe, plan: Plan) -> list[dict]:
    """What a stock vLLM cannot do with this artifact, so the launcher can check before it starts."""
    req = []
    if any(m.role == "embed" and m.scheme != KEEP for m in plan.modules):
        req.append({"feature": "int8 embed_tokens", "needs": "qconv runtime or a vLLM with quantized embeddings",
                    "reason": "stock vLLM loads embed_tokens unquantized"})
    for name, p in recipe.profiles.items():
        if p.kv_cache.startswith("kvarn"):
            req.append({"feature": f"profile {name}: {p.kv_cache} KV cache", "needs": "qconv runtime or the KVarN build of vLLM",
                        "reason": "KVarN is not a stock vLLM kv-cache dtype"})
    return req


def dry_run(opts: BuildOptions) -> DryRun:
    """The plan without loading weights: shapes come from safetensors headers or a meta-device model."""
    recipe = load_recipe(opts.recipe)
    src = resolve_source(opts.model, revision=opts.revision, weights=False)
    config = read_config(src.path)
    return DryRun(plan_model(src.path, config, recipe), recipe, config)


def build(opts: BuildOptions) -> Manifest:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from qconv.calibrate.data import load_calibration
    from qconv.convert.quantize import load_source_model, quantize

    t0 = time.time()
    recipe = load_recipe(opts.recipe)
    if opts.out is None:
        raise QconvError("no output folder", where="--out", fix="pass --out DIR")
    out = Path(opts.out)
    if out.exists() and not opts.force:
        raise QconvError(f"output folder already exists: {out}", where="--out",
                         fix="pass --force to replace it, or choose another --out")
    src = resolve_source(opts.model, revision=opts.revision)
    config = read_config(src.path)
    plan = plan_model(src.path, config, recipe)
    for w in plan.warnings:
        log.warning("plan: %s", w)
    source_info = src.info()
    source_info.num_parameters = plan.num_parameters

    cal = recipe.calibration
    seed = cal.seed if opts.seed is None else opts.seed
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(src.path)
    model_box = {}

    def model_loader():
        if "m" not in model_box:
            model_box["m"] = load_source_model(src.path, config)
        return model_box["m"]

    calib = load_calibration(opts.dataset or cal.dataset, tok, samples=opts.samples or cal.samples,
                             seq_len=opts.seq_len or cal.seq_len, seed=seed, default_dataset=cal.default_dataset,
                             split=cal.split, model_loader=model_loader)
    model = model_loader()
    model.eval()

    manifest = Manifest(
        source=source_info,
        recipe=RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict()),
        modules=plan.modules,
        calibration=calib.info,
        profiles={k: asdict(v) for k, v in recipe.profiles.items()},
        speculative=asdict(recipe.speculative),
        requires=requirements(recipe, plan),
        tools=tool_versions(),
        status="unchecked",
        build={"seed": seed, "family": plan.family, "untied_embeddings": plan.untie_embeddings,
               "estimated_bytes": plan.total_bytes, "source_bytes": plan.source_bytes, "warnings": plan.warnings},
    )
    gate_error = None
    with atomic_dir(out, force=opts.force) as tmp:
        quantize(model, plan.modules, recipe, calib.input_ids, tmp, untie=plan.untie_embeddings, seed=seed)
        del model_box["m"], model
        copy_side_files(src.path, tmp)
        gen_cfg = src.path / "generation_config.json"
        if gen_cfg.is_file():
            GenerationConfig.from_pretrained(src.path).save_pretrained(tmp)
        n_mtp = copy_mtp(src.path, tmp)
        if n_mtp:
            log.info("kept %d mtp.* tensors (bf16, in `ignore`) for MTP speculation", n_mtp)
        write_index(tmp)
        manifest.build["elapsed_s"] = round(time.time() - t0, 1)
        finalize(tmp, manifest)
        gate_error = _quality(opts, recipe, src.path, tmp, manifest)
        finalize(tmp, manifest)
    size = manifest.total_size()
    log.info("built %s: %.2f GB (source %.2f GB, %.1f%%) in %.0f s", out, size / 1e9, plan.source_bytes / 1e9,
             100 * size / max(plan.source_bytes, 1), time.time() - t0)
    if gate_error:
        raise gate_error
    return manifest


def _quality(opts: BuildOptions, recipe: Recipe, source: Path, artifact: Path, manifest: Manifest) -> GateFailure | None:
    """Measure the quality cost and apply the recipe's gates (eval area). Returns the gate failure, if any."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning("quality report skipped: no held-out text (pass --eval-text FILE_OR_HF_ID, or set quality.text "
                    "in the recipe); the artifact is marked unchecked")
        return None
    try:
        from qconv.eval import quality_report
        from qconv.eval.run import gate_failure
    except ImportError:
        log.warning("quality report skipped: qconv.eval is not available in this install")
        return None
    summary = quality_report(source, artifact, recipe, text=text, source_sha256=manifest.source.sha256,
                             num_parameters=manifest.source.num_parameters)
    manifest.quality = summary
    passed = summary.get("passed")
    manifest.status = "ok" if passed else ("failed" if passed is False else "unchecked")
    if passed is False and opts.gates:
        return gate_failure(summary)
    return None
