"""Reading a model folder's own files, once and checked: config.json (read_model_config) and safetensors headers
(the one header reader). Every verb that sizes, loads or measures weights reads them here first, so a damaged file is
one error naming it, never a library traceback or a size estimate of petabytes."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from qconv.errors import QconvError

# bits per element of each safetensors dtype (safetensors' own Dtype list)
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
HEADER_CAP = 100 << 20  # safetensors' own limit on the JSON header
# the config.json keys qconv reads itself (top level or in text_config), with their JSON types; others pass through
_INT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "mtp_num_hidden_layers",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
CONFIG_TYPES = {
    "model_type": str,
    "architectures": list,
    "layer_types": list,
    "tie_word_embeddings": bool,
    "attn_output_gate": bool,
    "text_config": dict,
    "quantization_config": dict,
    **{k: int for k in _INT_KEYS},
}
CONFIG_TYPE_NAMES = {
    str: "a string",
    list: "a list of strings",
    bool: "true/false",
    dict: "a mapping",
    int: "a non-negative integer",
}


def read_json_object(path: str | os.PathLike, what: str, fix: str, cap: int = 64 << 20) -> dict:
    """The JSON object in `path` (at most `cap` bytes); anything else (not JSON, not an object, too big, too deeply
    nested) is one QconvError naming the file."""
    path = Path(path)
    if not path.is_file():  # a device or a pipe (perhaps behind a link) would never end
        raise QconvError(f"{what} is not a regular file", where=str(path), fix=fix)
    try:
        if path.stat().st_size > cap:
            raise ValueError(f"{path.stat().st_size} bytes, more than {cap >> 20} MiB")
        data = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an over-long integer
        raise QconvError(f"{what} is not valid JSON: {str(e)[:200]}", where=str(path), fix=fix) from e
    if not isinstance(data, dict):
        raise QconvError(f"{what} is not a JSON object (it holds a {type(data).__name__})", where=str(path), fix=fix)
    return data


def load_tokenizer(folder: str | os.PathLike):
    """transformers' AutoTokenizer for a model folder; tokenizer files it cannot read (a tokenizer.json without its
    `added_tokens`, a wrong type inside) are one QconvError naming the folder, not a KeyError from transformers."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(Path(folder))
    except (KeyError, ValueError, TypeError, AttributeError, IndexError, RecursionError) as e:
        raise QconvError(
            f"cannot read the tokenizer: {type(e).__name__}: {str(e)[:200]}",
            where=str(folder),
            fix="the tokenizer files (tokenizer.json, tokenizer_config.json) are damaged or incomplete: re-download "
            "or re-copy them (or re-pull / rebuild the artifact)",
        ) from e


def read_model_config(folder: str | os.PathLike) -> dict:
    """A model folder's config.json as a mapping: the one reader every verb uses before handing the folder to a
    library, so a damaged file is one clear error, not a traceback from deep inside transformers."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        raise QconvError(
            f"no config.json in {folder}",
            where=str(folder),
            fix="pass a Hugging Face model folder (config.json + *.safetensors), a hub id, or a .gguf file",
        )
    fix = "re-download or re-copy the model (or rebuild the artifact)"
    data = read_json_object(cfg, "config.json", fix)
    for path, sub in (("", data), ("text_config.", data.get("text_config"))):
        for key, want in CONFIG_TYPES.items():
            v = sub.get(key) if isinstance(sub, dict) else None
            if v is None:
                continue
            ok = (
                isinstance(v, want)
                and not (want is int and isinstance(v, bool))
                and (want is not int or 0 <= v < 2**40)
                and (want is not list or all(isinstance(x, str) for x in v))
            )
            if not ok:
                raise QconvError(f"config.json: {path}{key} is not {CONFIG_TYPE_NAMES[want]}", where=str(cfg), fix=fix)
    if tcfg := (data.get("quantization_config") or {}).get("transform_config"):  # `{}`: no transforms
        transform_config(tcfg, str(cfg))
    return data


def transform_config(tcfg, where: str):
    """config.json's `quantization_config.transform_config` as compressed-tensors' TransformConfig; a malformed one
    is one QconvError naming the key path, not a pydantic traceback."""
    from compressed_tensors.transform import TransformConfig

    try:
        return TransformConfig.model_validate(tcfg)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        errors = getattr(e, "errors", None)
        first = ((errors() if callable(errors) else None) or [{}])[0]
        at = "".join(f".{x}" for x in first.get("loc", ()))
        raise QconvError(
            f"config.json: quantization_config.transform_config{at[:120]} is malformed: {first.get('msg', e)!s:.200}",
            where=where,
            fix="the checkpoint's config.json is damaged or was edited: re-download or rebuild it",
        ) from e


def _entry_problem(name: str, t) -> str | None:
    """Why tensor entry `t` is malformed (None: well-formed); its byte range must hold exactly its shape."""
    if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
        return f"tensor {name[:80]!r}: expected {{dtype, shape, data_offsets}}"
    dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        return f"tensor {name[:80]!r}: unknown dtype {str(dtype)[:20]!r}"
    ints = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)  # noqa: E731
    if not ints(shape) or not ints(offs) or len(offs) != 2 or offs[0] > offs[1]:
        return f"tensor {name[:80]!r}: shape and data_offsets must be lists of non-negative integers"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offs[1] - offs[0]:
        return (
            f"tensor {name[:80]!r}: shape {shape[:8]} of {dtype} needs {bits / 8:.0f} bytes, its byte range "
            f"holds {offs[1] - offs[0]}"
        )
    return None


def safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """The tensor entries ({dtype, shape, data_offsets}) of a safetensors file, read from its header only and checked
    as the safetensors library checks them: each entry's bytes match its dtype and shape, the ranges tile the data
    exactly, and the data ends where the file does. Anything else is one QconvError naming the file."""
    path = Path(path)
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 1 or n > HEADER_CAP or 8 + n > size:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        meta = header.get("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("__metadata__ is not a mapping of strings")
        tensors = {k: t for k, t in header.items() if k != "__metadata__"}
        for name, t in tensors.items():
            if problem := _entry_problem(name, t):
                raise ValueError(problem)
        end = 0
        for begin, stop in sorted(t["data_offsets"] for t in tensors.values()):
            if begin != end:
                raise ValueError(f"tensor byte ranges overlap or leave a gap at offset {end}")
            end = stop
        if 8 + n + end != size:
            raise ValueError(f"tensor data needs {8 + n + end} bytes, the file has {size}")
    except (OSError, ValueError, RecursionError, struct.error) as e:  # JSONDecodeError is a ValueError
        raise QconvError(
            f"corrupt or truncated safetensors file: {e}",
            where=str(path),
            fix="re-download or re-copy the model files (or re-pull / rebuild the artifact)",
        ) from e
    return tensors


# compressed-tensors' per-module parameters: a packed weight needs its scale and shape, and every parameter needs the
# weight it describes (a renamed tensor in a header otherwise fails deep in the decompressor, or is silently dropped)
PACKED_NEEDS = ("weight_scale", "weight_shape")
QPARAMS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
ROTATION_STORED = "_input.weight"  # `<module>.<scheme>_input.weight`: an input-rotation block (qconv.convert.rotation)
ORTHOGONAL_TOL = 1e-3
ELEMENTS_PER_BYTE = 8  # the most weights a stored byte can hold (1-bit): a config that implies more lies about sizes


def _check_quantized_groups(tensors: dict[str, dict], folder: Path) -> None:
    names = set(tensors)
    fix = "the artifact's weight files are damaged or were edited: re-pull or rebuild it"
    for name in sorted(names):
        prefix, _, param = name.rpartition(".")
        missing = []
        if param == "weight_packed":
            missing = [f"{prefix}.{p}" for p in PACKED_NEEDS if f"{prefix}.{p}" not in names]
        elif param in QPARAMS and not {f"{prefix}.weight_packed", f"{prefix}.weight"} & names:
            missing = [f"{prefix}.weight_packed"]
        if missing:
            raise QconvError(
                f"tensor {name[:120]!r} comes without {missing[0][:120]!r} in the safetensors headers",
                where=str(folder),
                fix=fix,
            )


def _check_rotations(folder: Path, names: set[str]) -> None:
    """Each stored rotation block must be square, finite and, divided by sqrt(b), orthogonal: a block of NaN (or
    scaled by 1e300) turned every input into garbage and generate printed nothing. Checked with a few random probes
    (VᵀV x = x), O(b²) per block, so a large block costs no matrix product."""
    if not names:
        return
    import torch
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(0)
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as sf:
            for name in sorted(names & set(sf.keys())):
                t = sf.get_tensor(name).double()
                problem = None
                if t.dim() != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
                    problem = f"shape {list(t.shape)} is not a square matrix"
                elif not torch.isfinite(t).all():
                    problem = "it holds NaN or infinite values"
                else:
                    v = t / math.sqrt(t.shape[0])
                    x = torch.randn(t.shape[0], 4, generator=gen, dtype=torch.float64)
                    err = ((v.T @ (v @ x)) - x).norm() / x.norm()
                    if not err <= ORTHOGONAL_TOL:
                        problem = f"it is not orthogonal (relative error {float(err):.3g})"
                if problem:
                    raise QconvError(
                        f"rotation block {name[:120]!r}: {problem}",
                        where=str(shard),
                        fix="the artifact's weight files are damaged or were edited: re-pull or rebuild it",
                    )


def _check_sizes(config: dict, tensors: dict[str, dict], stored: int, folder: Path) -> None:
    """config.json's vocabulary and width against the weights really stored, before anything is allocated from them
    (a vocab_size of 1e12 asked eval for 1.15e15 bytes)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab, hidden = text.get("vocab_size", config.get("vocab_size")), text.get("hidden_size", config.get("hidden_size"))
    where, fix = str(folder / "config.json"), "re-download or re-copy config.json (or re-pull / rebuild the artifact)"
    if isinstance(vocab, int) and isinstance(hidden, int) and vocab * hidden > ELEMENTS_PER_BYTE * stored:
        raise QconvError(
            f"config.json: vocab_size {vocab} x hidden_size {hidden} is more weights than the {stored} bytes of "
            "safetensors files can hold",
            where=where,
            fix=fix,
        )
    for name, t in tensors.items():
        if name.endswith(("embed_tokens.weight", "embed_tokens.weight_packed")) and isinstance(vocab, int):
            if t["shape"] and t["shape"][0] != vocab:
                raise QconvError(
                    f"config.json: vocab_size {vocab} does not match the {t['shape'][0]} rows of {name[:120]}",
                    where=where,
                    fix=fix,
                )


def check_weight_files(folder: str | os.PathLike, config: dict | None = None) -> None:
    """Every *.safetensors header in `folder`, checked before a library loads them (serve, generate, eval, check):
    well-formed, every quantized parameter beside the weight it belongs to, and sizes config.json agrees with
    (`config`: the folder's config.json already read; None: read it here)."""
    folder = Path(folder)
    tensors: dict[str, dict] = {}
    stored = 0
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(safetensors_header(shard))
        stored += shard.stat().st_size
    _check_quantized_groups(tensors, folder)
    _check_rotations(folder, {n for n in tensors if n.endswith(ROTATION_STORED)})
    if tensors and (config is not None or (folder / "config.json").is_file()):
        _check_sizes(config if config is not None else read_model_config(folder), tensors, stored, folder)
