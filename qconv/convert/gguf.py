"""GGUF -> Hugging Face safetensors folder, through transformers' own GGUF loader.

Transformers dequantizes the GGUF tensors; we fix what its conversion gets wrong (eos/pad ids from the GGUF
metadata) and drop the GGUF quantizer so the folder is a plain bf16/fp32 checkpoint any tool loads.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from qconv.errors import QconvError
from qconv.fsutil import atomic_dir

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16", "float16", "float32"}


@contextlib.contextmanager
def one_parse():
    """Within the block, each GGUF file is parsed once: transformers' loader builds a new `GGUFReader` for the config,
    the tokenizer and the weights (five parses of the file's vocabulary per import, most of the import's time). Its
    weight-name mapping also builds gguf's `TensorNameMap` (every tensor name of the architecture at every depth)
    anew for each module of the model it walks, hundreds of times over: here once per architecture and depth."""
    from qconv.convert import patches

    reader_class, name_map = patches.current("gguf_reader"), patches.current("gguf_tensor_name_map")
    readers: dict[tuple[str, str], object] = {}
    maps: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    def tensor_name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    with patches.swap(gguf_reader=reader, gguf_tensor_name_map=tensor_name_map):
        yield reader


def _gguf_special_ids(reader) -> dict[str, int]:
    out = {}
    for key, name in (
        ("tokenizer.ggml.eos_token_id", "eos"),
        ("tokenizer.ggml.bos_token_id", "bos"),
        ("tokenizer.ggml.padding_token_id", "pad"),
    ):
        field = reader.fields.get(key)
        if field is not None:
            out[name] = int(field.parts[field.data[0]][0])
    return out


def import_gguf(gguf_file: str | Path, out: str | Path, *, dtype: str = "bfloat16", force: bool = False) -> Path:
    """Write `out` as an HF model folder (config, safetensors, tokenizer, chat template) from one .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise QconvError(f"GGUF file not found: {gguf_file}", fix="pass the path of an existing .gguf file")
    if dtype not in _DTYPES:
        raise QconvError(f"unknown dtype {dtype!r}", fix=f"use one of {sorted(_DTYPES)}")
    if out.exists() and not force:
        raise QconvError(f"output folder already exists: {out}", fix="pass --force to replace it, or another path")
    with one_parse() as reader:
        try:
            special = _gguf_special_ids(reader(gguf_file))
        except Exception as e:  # noqa: BLE001 - any parse failure means the file is not usable GGUF
            raise QconvError(
                f"cannot read GGUF file: {e}", where=str(gguf_file), fix="check the file is a complete .gguf"
            ) from e

        log.info("importing %s (transformers GGUF loader, dequantizing to %s)", gguf_file.name, dtype)
        d, f = str(gguf_file.parent), gguf_file.name
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype))
    # The GGUF loader leaves a quantizer attached; a plain checkpoint must not claim GGUF quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    # transformers' conversion can pick the wrong eos (SmolLM2: <|im_start|> instead of the GGUF's <|im_end|>).
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    for name in ("eos", "bos", "pad"):
        if name in special and special[name] < len(vocab):
            setattr(tok, f"{name}_token", vocab[special[name]])
            setattr(model.config, f"{name}_token_id", special[name])
    # transformers' GGUF tokenizer says clean_up_tokenization_spaces=True, which it then ignores for a BPE tokenizer
    # with a warning on every load (the cleanup would strip spaces before punctuation): record what it does.
    if type(getattr(getattr(tok, "backend_tokenizer", None), "model", None)).__name__ == "BPE":
        tok.clean_up_tokenization_spaces = False
    gen = GenerationConfig.from_model_config(model.config)
    gen.eos_token_id = model.config.eos_token_id
    gen.pad_token_id = getattr(model.config, "pad_token_id", None)

    with atomic_dir(out, force=force) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        gen.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    log.info("wrote %s", out)
    return out
