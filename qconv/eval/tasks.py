"""lm-eval bridge: run tasks on the original and the quantized model, report both and the recovery ratio.

Shipped tasks (qconv/eval/tasks/*.yaml) read local files so they run offline; their data path comes from
`--task-data NAME=PATH` or env QCONV_TASK_DATA_<NAME>. Other names go to lm-eval's own registry (those usually
need the Hub). Backend: vLLM where it is installed and a GPU is present, else transformers (HF) on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from importlib import resources
from pathlib import Path

from qconv.errors import QconvError
from qconv.eval.record import TaskResult, TaskResults

log = logging.getLogger(__name__)


def shipped_tasks() -> dict[str, Path]:
    root = resources.files("qconv.eval") / "tasks"
    return {p.name[:-5]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def _shipped_config(name: str, yaml_path: Path, task_data: dict[str, str], max_gen_toks: int | None) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    path = task_data.get(name) or os.environ.get(f"QCONV_TASK_DATA_{name.upper()}")
    if not path:
        raise QconvError(
            f"task {name} needs a local data file",
            where="--tasks",
            fix=f"pass --task-data {name}=PATH (or set QCONV_TASK_DATA_{name.upper()})",
        )
    if not Path(path).is_file():
        raise QconvError(
            f"data file for task {name} not found: {path}", where="--task-data", fix="pass an existing file"
        )
    cfg = load_yaml(yaml_path)
    cfg["dataset_kwargs"]["data_files"] = {"test": str(Path(path).resolve())}
    if max_gen_toks and "generation_kwargs" in cfg:
        cfg["generation_kwargs"]["max_gen_toks"] = max_gen_toks
    return cfg


def resolve_tasks(names: list[str], task_data: dict[str, str] | None = None, max_gen_toks: int | None = None) -> list:
    """Task specs for lm_eval.simple_evaluate: shipped YAMLs with their data filled in, else registered names."""
    shipped, task_data = shipped_tasks(), task_data or {}
    specs, others = [], []
    for n in names:
        if n in shipped:
            specs.append(_shipped_config(n, shipped[n], task_data, max_gen_toks))
        else:
            others.append(n)
    if others:
        from lm_eval.tasks import TaskManager

        known = set(TaskManager().all_tasks)
        unknown = [n for n in others if n not in known]
        if unknown:
            raise QconvError(
                f"unknown task(s): {', '.join(unknown)}",
                where="--tasks",
                fix=f"use a shipped task ({', '.join(sorted(shipped))}) or an lm-eval task name",
            )
        specs += others
    return specs


def _lm(path: Path, batch_size: int):
    """vLLM where usable, else an HF model decompressed once (same loader as the KLD measurement)."""
    import torch

    if importlib.util.find_spec("vllm") and torch.cuda.is_available():
        return "vllm", {"pretrained": str(path), "dtype": "bfloat16"}
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from qconv.convert.device import resolve_device
    from qconv.eval.forward import load_for_eval

    return HFLM(
        pretrained=load_for_eval(path, resolve_device("auto")),
        tokenizer=AutoTokenizer.from_pretrained(path),
        batch_size=batch_size,
    ), None


def _task_manager(specs: list):
    """One lm-eval task index for both models (`simple_evaluate` otherwise builds its own each time). Indexing
    lm-eval's own tasks reads every YAML it ships; shipped tasks alone need none of them (docs/BENCHMARKS.md)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=not all(isinstance(s, dict) for s in specs))


def _evaluate(path: Path, specs: list, limit: int | None, batch_size: int, manager) -> tuple[dict, str]:
    import lm_eval

    model, model_args = _lm(path, batch_size)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=specs,
        limit=limit,
        log_samples=False,
        bootstrap_iters=0,
        task_manager=manager,
    )
    return out, "vllm" if isinstance(model, str) else "hf"


def _primary(name: str, metrics: dict) -> str:
    """The metric a shipped task names as primary (metadata.qconv_primary), else the first one reported."""
    cfg = shipped_tasks().get(name)
    if cfg is not None:
        from lm_eval.tasks._yaml_loader import load_yaml

        prim = (load_yaml(cfg, resolve_func=False).get("metadata") or {}).get("qconv_primary")
        if prim in metrics:
            return prim
    return next(k for k in metrics if "," in k and "_stderr" not in k)


def run_tasks(
    source: Path,
    artifact: Path,
    names: list[str],
    *,
    limit: int | None = None,
    task_data: dict[str, str] | None = None,
    max_gen_toks: int | None = None,
    batch_size: int = 32,
) -> TaskResults:
    """Each task on both models; `max_gen_toks` caps generation in shipped tasks (short CPU smoke runs)."""
    specs = resolve_tasks(names, task_data, max_gen_toks)
    manager = _task_manager(specs)
    base, backend = _evaluate(source, specs, limit, batch_size, manager)
    quant, _ = _evaluate(artifact, specs, limit, batch_size, manager)
    results: dict[str, TaskResult] = {}
    for name, bm in base["results"].items():
        qm = quant["results"].get(name, {})
        higher = base.get("higher_is_better", {}).get(name, {})
        key = _primary(name, bm)
        b, q = float(bm[key]), float(qm[key])
        hib = higher.get(key.split(",")[0], True)
        ratio = (q / b if b else None) if hib else (b / q if q else None)
        results[name] = TaskResult(
            metric=key,
            higher_is_better=hib,
            base=b,
            quantized=q,
            recovery=ratio,
            samples=base.get("n-samples", {}).get(name, {}).get("effective"),
        )
    return TaskResults(limit=limit, max_gen_toks=max_gen_toks, backend=backend, results=results)
