"""Calibration sets: a local file (.txt/.jsonl/.json/.parquet), an HF dataset id, or text the model writes itself.

Every set ends as `samples` token sequences of at most `seq_len`, chosen with a seed, and a sha256 over the token
ids so the manifest (and the build cache) can tell two calibration sets apart exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from qconv import progress
from qconv.errors import QconvError
from qconv.fsutil import sha256_json
from qconv.manifest import CalibrationInfo

log = logging.getLogger(__name__)

# Neutral openers for self-generated calibration: varied registers, no benchmark content.
SELF_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "Write a Python function that merges two sorted lists, with comments.",
    "Describe the history of the printing press.",
    "What are good habits for learning a new language?",
    "Summarize the causes of the seasons on Earth.",
    "Write a polite email asking to reschedule a meeting.",
    "Solve step by step: a train travels 120 km in 1.5 hours. What is its average speed?",
]


@dataclass
class CalibSet:
    input_ids: list[list[int]]
    info: CalibrationInfo


def _records_to_texts(records, tokenizer, where: str) -> list[str]:
    texts = []
    for i, r in enumerate(records):
        if isinstance(r, str):
            texts.append(r)
        elif "messages" in r and r["messages"]:
            if getattr(tokenizer, "chat_template", None):
                texts.append(tokenizer.apply_chat_template(r["messages"], tokenize=False))
            else:
                texts.append("\n".join(str(m.get("content", "")) for m in r["messages"]))
        elif "text" in r:
            texts.append(str(r["text"]))
        elif "prompt" in r:
            texts.append(str(r["prompt"]) + str(r.get("completion", r.get("response", ""))))
        elif "question" in r:
            texts.append(str(r["question"]) + "\n" + str(r.get("answer", "")))
        else:
            raise QconvError(
                f"calibration record {i} has none of the fields messages/text/prompt/question (keys: {sorted(r)})",
                where=where,
                fix="give each record a `text` field, or chat `messages` [{role, content}]",
            )
    return [t for t in texts if t.strip()]


def _read_file(path: Path, tokenizer) -> list[str]:
    where = str(path)
    if not path.is_file():
        raise QconvError(f"calibration file not found: {path}", where="--dataset", fix="check the path")
    try:
        if path.suffix == ".txt":
            return [path.read_text(encoding="utf-8")]
        if path.suffix == ".jsonl":
            return _records_to_texts(
                [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()],
                tokenizer,
                where,
            )
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return _records_to_texts(data if isinstance(data, list) else [data], tokenizer, where)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return _records_to_texts(pq.read_table(path).to_pylist(), tokenizer, where)
    except QconvError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, OSError, ValueError) as e:
        raise QconvError(
            f"cannot read calibration file: {type(e).__name__}: {e}",
            where=where,
            fix="pass UTF-8 .txt, .jsonl/.json records with `text` or `messages`, or .parquet",
        ) from e
    raise QconvError(
        f"unsupported calibration file type {path.suffix!r}",
        where=where,
        fix="use .txt, .jsonl, .json or .parquet, or an HF dataset id",
    )


def _read_hub(dataset_id: str, split: str, tokenizer, limit: int) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split, streaming=True)
        records = [r for _, r in zip(range(limit), ds)]
    except Exception as e:  # noqa: BLE001 - datasets raises many types for offline / missing
        raise QconvError(
            f"cannot load HF dataset {dataset_id!r} split {split!r}: {type(e).__name__}: {e}",
            where="--dataset",
            fix="check the id and split, or pass a local .txt/.jsonl/.parquet file",
        ) from e
    return _records_to_texts(records, tokenizer, dataset_id)


def _pack(texts: list[str], tokenizer, samples: int, seq_len: int, seed: int) -> list[list[int]]:
    """Concatenate documents (eos between them), cut into seq_len windows, pick `samples` of them seeded."""
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    need = samples * seq_len * 4  # enough windows to choose from, without tokenizing a huge corpus
    for i in order:
        stream.extend(tokenizer(texts[i], add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if len(stream) >= need:
            break
    windows = [stream[j : j + seq_len] for j in range(0, len(stream) - seq_len + 1, seq_len)]
    if not windows:
        if len(stream) < 16:
            raise QconvError(
                f"calibration data has only {len(stream)} tokens",
                where="--dataset",
                fix="pass more text (at least a few thousand tokens)",
            )
        windows = [stream]
    if len(windows) < samples:
        log.warning(
            "calibration data yields %d windows of %d tokens; using all of them (asked for %d)",
            len(windows),
            seq_len,
            samples,
        )
        return windows
    return [windows[i] for i in sorted(rng.sample(range(len(windows)), samples))]


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa repeats K/V to every query head whenever a padding mask is given, so each step of a
    left-padded batch copied the whole cache; torch's SDPA takes grouped K/V and the mask itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = attention_mask is None or query.shape[1] == key.shape[1] or key.shape[-1] != value.shape[-1]
    if plain or kwargs.get("position_bias") is not None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _grouped_attention(model):
    """The block's sdpa attention takes grouped K/V with a padding mask (`_grouped_sdpa`); other implementations
    (eager, a KV simulation) are left as they are."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    before = model.config._attn_implementation
    if before != "sdpa":
        yield model
        return
    AttentionInterface.register("qconv_grouped_sdpa", _grouped_sdpa)
    AttentionMaskInterface.register("qconv_grouped_sdpa", sdpa_mask)
    model.set_attn_implementation("qconv_grouped_sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def self_generate(model, tokenizer, samples: int, seq_len: int, seed: int, dtype=None) -> list[list[int]]:
    """The model writes its own calibration text from neutral prompts (no data, no network needed).

    Capped at 16 windows of 256 tokens: enough for GPTQ's Hessians on a demo, cheap on a CPU. Twice as many
    sequences as windows are written side by side, each half as long, then laid end to end and cut into the
    windows: half the decode steps, each a wider matmul (docs/BENCHMARKS.md, "First contact"). Generated in
    `dtype` (default: float32 where the device has no native bf16, qconv.compute)."""
    import torch

    from qconv.compute import compute_dtype, computing_in

    n, width = min(samples, 16), min(seq_len, 256)
    prompts = []
    for i in range(2 * n):
        msg = [{"role": "user", "content": SELF_PROMPTS[i % len(SELF_PROMPTS)]}]
        if getattr(tokenizer, "chat_template", None):
            prompts.append(tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False))
        else:
            prompts.append(msg[0]["content"])
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        # each row: its prompt and what follows, about half a window, so the rows fill the n windows
        half = -(-width // 2)
        new = max(8, half - int(enc["attention_mask"].sum(1).float().mean()))
        torch.manual_seed(seed)
        with torch.no_grad(), computing_in(model, dtype or compute_dtype(model.device.type)), _grouped_attention(model):
            out = model.generate(
                **enc,
                do_sample=True,
                max_new_tokens=new,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=tokenizer.pad_token_id,
            )
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    rows, plen = [], enc["input_ids"].shape[1]
    for row, mask in zip(out.tolist(), enc["attention_mask"]):
        start = int((mask == 0).sum())  # drop left padding
        gen = row[plen:]
        if tokenizer.eos_token_id in gen:  # and what follows the first eos (padding)
            gen = gen[: gen.index(tokenizer.eos_token_id) + 1]
        rows.append((row[start:plen] + gen)[:half])  # two rows a window: every prompt gets its share
    return equal_windows(rows, n)


def equal_windows(rows: list[list[int]], count: int | None = None) -> list[list[int]]:
    """The same tokens, end to end, in `count` windows (default: one a row) of one length, the remainder dropped:
    samples of one length go through GPTQ's calibration passes together (qconv.convert.quantize)."""
    count = count or len(rows)
    if count == len(rows) and len({len(r) for r in rows}) <= 1:
        return rows
    flat = [t for r in rows for t in r]
    w = len(flat) // count
    return [flat[i * w : (i + 1) * w] for i in range(count)]


def load_calibration(
    dataset: str | None,
    tokenizer,
    *,
    samples: int,
    seq_len: int,
    seed: int,
    default_dataset: str | None = None,
    split: str = "train",
    model_loader=None,
    dtype=None,
) -> CalibSet:
    """Resolve --dataset (file, HF id, or None) into token windows. With None: the recipe's default HF dataset,
    and when that cannot be reached, text the source model generates itself (announced and recorded)."""
    kind, ident = "file", dataset
    if dataset:
        p = Path(dataset).expanduser()
        if p.exists() or p.suffix in (".txt", ".jsonl", ".json", ".parquet") or dataset.startswith((".", "/", "~")):
            texts, ident = _read_file(p, tokenizer), str(p.resolve())
        else:
            kind, texts = "hf", _read_hub(dataset, split, tokenizer, samples * 8)
        ids = _pack(texts, tokenizer, samples, seq_len, seed)
    else:
        ids = None
        if default_dataset:
            try:
                texts = _read_hub(default_dataset, split, tokenizer, samples * 8)
                kind, ident, ids = "hf", default_dataset, _pack(texts, tokenizer, samples, seq_len, seed)
            except QconvError as e:
                log.warning("default calibration dataset unavailable (%s)", e.what.split(":")[0])
        if ids is None:
            if model_loader is None:
                raise QconvError("no calibration data", fix="pass --dataset FILE_OR_HF_ID")
            log.warning(
                "calibration: no dataset given and none reachable -> SELF-GENERATED calibration text "
                "(the source model writes it from neutral prompts); pass --dataset for your own domain"
            )
            kind, ident = "self", "self-generated"
            ids = self_generate(model_loader(), tokenizer, samples, seq_len, seed, dtype)
    info = CalibrationInfo(
        kind=kind,
        id=ident,
        sha256=sha256_json(ids),
        samples=len(ids),
        seq_len=seq_len,
        seed=seed,
        tokens=sum(len(x) for x in ids),
    )
    log.info(
        "calibration: %s, %d samples of up to %d tokens, %d tokens in all",
        ident if kind != "hf" else f"HF {ident}",
        info.samples,
        seq_len,
        info.tokens,
        extra=progress.SHOW,
    )
    return CalibSet(ids, info)
