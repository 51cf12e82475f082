"""Speculative decoding workloads built from user files (copy, code, codecopy, testcopy, chat, math; read as
qconv.bench.workloads reads them) and our decode with and without speculation on them, in process, interleaved per
prompt (machine load hits both alike). Driven by bench/spec_bench.py; `qconv bench` measures served speed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qconv.bench.workloads import jsonl_field, passages
from qconv.compute import dtype_name
from qconv.engine.generate import GenerationConfig, GenerationStats, encode_prompt, generate_tokens
from qconv.engine.spec import SpecConfig
from qconv.errors import QconvError

WORKLOADS = ("copy", "code", "codecopy", "testcopy", "chat", "math")
FILES = {  # each workload's default data file, in ../shared/data
    "copy": "wikitext-2-raw-test.txt",
    "code": "humaneval.jsonl",
    "codecopy": "humaneval.jsonl",
    "testcopy": "humaneval.jsonl",
    "chat": "mt_bench_questions.jsonl",
    "math": "gsm8k_test.jsonl",
}
COPY_INSTRUCTION = "Repeat the following document exactly, word for word.\n\n"
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{}```"
CODE_COPY_INSTRUCTION = "Repeat the following Python code exactly.\n\n```python\n{}```"


def workload_texts(workload: str, data: Path, n: int) -> list[str]:
    """The user messages of a workload: copy = a text file's passages; code = HumanEval-style jsonl ("prompt");
    codecopy = the same jsonl's whole functions ("prompt" + "canonical_solution") to repeat, a copy the model
    makes verbatim; testcopy = the same jsonl's unit tests ("test") to repeat, lines that share their openings
    (`assert candidate(`); chat = MT-Bench-style jsonl (first of "turns"); math = GSM8K-style jsonl ("question")."""
    if workload not in WORKLOADS:
        raise QconvError(f"unknown workload {workload!r}", fix=f"one of {', '.join(WORKLOADS)}")
    data = Path(data)
    if not data.is_file():
        raise QconvError("data file not found", where=str(data), fix="pass --data FILE for this workload")
    if workload == "copy":
        texts = [COPY_INSTRUCTION + p for p in passages(data.read_text(errors="replace"), n)]
    elif workload == "code":
        texts = [CODE_INSTRUCTION.format(p) for p in jsonl_field(data, ("prompt",), n)]
    elif workload == "codecopy":
        whole = zip(jsonl_field(data, ("prompt",), n), jsonl_field(data, ("canonical_solution",), n))
        texts = [CODE_COPY_INSTRUCTION.format(p + s) for p, s in whole]
    elif workload == "testcopy":
        texts = [CODE_COPY_INSTRUCTION.format(p) for p in jsonl_field(data, ("test",), n)]
    elif workload == "chat":
        texts = [turns[0] for turns in jsonl_field(data, ("turns",), n)]
    else:
        texts = jsonl_field(data, ("question",), n)
    if not texts:
        raise QconvError(f"no {workload} prompts found", where=str(data))
    return texts


def _ours(model, prompts: list[list[int]], cfg: GenerationConfig) -> tuple[dict, list[list[int]]]:
    """Plain and speculative decode per prompt, interleaved. Greedy outputs must agree token for token."""
    plain, spec = GenerationStats(), GenerationStats()
    identical = True
    outputs = []
    for ids in prompts:
        a = list(generate_tokens(model, ids, replace(cfg, spec=SpecConfig("none")), plain))
        b = list(generate_tokens(model, ids, cfg, spec))
        identical &= a == b
        outputs.append(b)
    d = spec.to_dict()
    d.update(
        plain_decode_tok_s=round(plain.decode_tok_s, 2),
        speedup=round(plain.decode_s / spec.decode_s, 3) if spec.decode_s else None,
        speedup_end_to_end=round((plain.prefill_s + plain.decode_s) / (spec.prefill_s + spec.decode_s), 3),
        identical_to_plain=identical if cfg.sampling.greedy else None,
    )
    return d, outputs


def run_bench(
    path,
    workload: str,
    data,
    *,
    prompts: int = 5,
    cfg: GenerationConfig | None = None,
    threads: int = 0,
    dequantize: bool = False,
    dtype: str | None = None,
    device: str | None = None,
    keep_spec: bool = False,
) -> tuple[dict, list[list[int]], list[list[int]]]:
    """One workload: our speculative vs plain decode. dtype as the CLI picks it (engine_dtype). The MTP part of the
    config is dropped for a model without the head unless `keep_spec` (the user asked for it). Returns the report,
    the prompts' token ids and our outputs (bench/spec_bench.py replays transformers' drafter on them)."""
    import torch

    from qconv.engine.loader import engine_dtype, load_model, load_tokenizer

    if threads:
        torch.set_num_threads(threads)
    path = Path(path)
    cfg = cfg or GenerationConfig(max_tokens=128, spec=SpecConfig("lookup"))
    texts = workload_texts(workload, Path(data), prompts)
    tok = load_tokenizer(path)
    ids = [encode_prompt(tok, t, chat=bool(getattr(tok, "chat_template", None))) for t in texts]
    dtype = engine_dtype(path, dequantize, dtype)
    model = load_model(path, dtype=dtype, int_kernels=False if dequantize else None)
    if device:
        model = model.to(device)
    if not keep_spec:
        cfg = replace(cfg, spec=cfg.spec.for_model(model))
    sc = cfg.spec
    report = {
        "workload": workload,
        "model": str(path),
        "dtype": dtype_name(dtype),
        "prompts": len(ids),
        "max_tokens": cfg.max_tokens,
        "spec": sc.method,
        "k": sc.k,
        "max_block": sc.max_block,
        "ngram": [sc.ngram_min, sc.ngram_max],
        "adaptive": sc.adaptive,
        "threads": torch.get_num_threads(),
        "device": str(model.device),
    }
    report["ours"], outputs = _ours(model, ids, cfg)
    return report, ids, outputs
