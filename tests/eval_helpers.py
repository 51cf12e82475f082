"""Test/benchmark helpers for the eval area: plain llmcompressor W4A16 artifacts (RTN or GPTQ) with a minimal
qconv.json, so quality measurement can be tested without the build pipeline."""

from __future__ import annotations

import json
from pathlib import Path

from qconv.fsutil import atomic_dir


def group_for(in_features: int, sizes=(128, 64, 32)) -> int:
    return next(g for g in sizes if in_features % g == 0)


def _config_groups(model, symmetric: bool = True) -> tuple[dict, dict[str, int]]:
    """One W4A16 group per group size: 128 where it divides in_features, else 64/32 (recorded per module);
    symmetric, or with zero points."""
    import torch

    chosen = {
        n: group_for(m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")
    }
    groups = {}
    for g in sorted(set(chosen.values()), reverse=True):
        names = [n for n, v in chosen.items() if v == g]
        groups[f"group_{g}"] = {
            "targets": [f"re:^{n}$" for n in names],
            "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": g},
        }
    return groups, chosen


def calibration_dataset(tokenizer, text_file: Path, samples: int, seq_len: int):
    from datasets import Dataset

    ids = tokenizer(Path(text_file).read_text(), add_special_tokens=False)["input_ids"]
    rows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(min(samples, len(ids) // seq_len))]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def make_w4_artifact(
    source: Path,
    out: Path,
    *,
    algorithm: str = "rtn",
    calib_text: Path | None = None,
    samples: int = 32,
    seq_len: int = 512,
    pipeline: str = "basic",
    gates_recipe: str = "3090",
    symmetric: bool = True,
) -> Path:
    """RTN (QuantizationModifier) or GPTQ W4A16 of every Linear but lm_head, saved compressed + qconv.json."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qconv.convert.sources import ResolvedSource
    from qconv.manifest import Manifest, ModuleDecision, RecipeInfo, hash_artifact_files, tool_versions
    from qconv.recipes.recipe import load_recipe

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(source)
    groups, chosen = _config_groups(model, symmetric)
    num_params = sum(p.numel() for p in model.parameters())
    if algorithm == "gptq":
        ds = calibration_dataset(tok, calib_text, samples, seq_len)
        modifier = GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01)
        oneshot(
            model=model,
            recipe=modifier,
            dataset=ds,
            num_calibration_samples=len(ds),
            max_seq_length=seq_len,
            pipeline=pipeline,
        )
    else:
        oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
    src = ResolvedSource(path=Path(source), kind="hf_dir", id=str(Path(source).resolve()))
    info = src.info()
    info.num_parameters = num_params
    with atomic_dir(out, force=True) as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        tok.save_pretrained(tmp)
        # Gates come from the recorded recipe; these plain W4A16 artifacts are judged by the 3090 recipe's tiers.
        recipe = load_recipe(gates_recipe)
        m = Manifest(
            source=info,
            recipe=RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict()),
            modules=[
                ModuleDecision(name=n, role="linear", scheme="w4a16", bits=4, group_size=g, symmetric=symmetric)
                for n, g in chosen.items()
            ],
            tools=tool_versions(),
            status="unchecked",
        )
        m.files = hash_artifact_files(tmp)
        m.write(tmp)
    return out


def load_json(p: Path) -> dict:
    return json.loads(Path(p).read_text())


def eval_report(seed: int = 0, tokens: int = 256, kld: float = 0.02, passed: bool | None = True):
    """An EvalReport (qconv.eval.record) with metrics summarized from seeded per-token statistics instead of a model
    run: for tests that judge or summarize a report without measuring one."""
    import numpy as np

    from qconv.eval.metrics import TokenStats, summarize
    from qconv.eval.record import EvalReport, EvalSettings, MeasuredSource, ReferenceInfo, TextInfo

    rng = np.random.default_rng(seed)
    k = rng.exponential(kld, tokens)
    nll = rng.exponential(2.0, tokens)
    stats = TokenStats([k], [k], [(rng.random(tokens) > kld).astype(np.float64)], [nll], [nll + k])
    return EvalReport(
        artifact="/a",
        source=MeasuredSource(path="/s", sha256="0" * 64, num_parameters=1000, kind="model"),
        settings=EvalSettings("t", window=tokens),
        text=TextInfo(label="t", sha256="0" * 64, tokens_scored=tokens, windows=1, window=tokens, stride=tokens),
        reference=ReferenceInfo(storage="full", topk=0, vocab_size=64, describe="full", cache="/c"),
        bits_per_weight=4.5,
        artifact_bytes=562,
        weights=summarize(stats),
        machine="test",
        date="2026-01-01T00:00:00+00:00",
        elapsed_s=0.0,
        verdicts=[],
        passed=passed,
    )


def quality_summary(seed: int = 0, tokens: int = 256, kld: float = 0.02, passed: bool | None = True) -> dict:
    """qconv.json's `quality` as a build writes it (qconv.eval.report.summary of a report), from seeded per-token
    statistics instead of a model run: for manifests in tests that measure nothing."""
    from qconv.eval.report import summary

    report = eval_report(seed, tokens, kld, passed)
    return json.loads(json.dumps(summary(report).data))  # as read back from qconv.json
