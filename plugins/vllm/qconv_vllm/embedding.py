"""Quantized embed_tokens in stock vLLM.

vLLM 0.32 has the method (`CompressedTensorsEmbeddingWNA16Int`, dequant-on-lookup of a pack-quantized embedding),
but no model reaches it: `LlamaModel`, `Qwen3_5Model` and `Qwen3_5MultiTokenPredictor` build their
`VocabParallelEmbedding` without a `prefix` (and the Qwen3.5 ones without `quant_config`), so the config group
that targets `embed_tokens` never matches and loading fails on `embed_tokens.weight_packed`. While one of those
models is being built, its `VocabParallelEmbedding(...)` call without a prefix gets the name its weights load
under (and the model's quant config where it passed none). The method's lookup is a Triton kernel; on CPU (no Triton) a plain torch lookup takes its place.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable

from qconv_vllm import patches
from qconv_vllm.packing import dequantize_rows

log = logging.getLogger(__name__)

# (quant_config, layer name) for the next bare embedding built inside a patched model's __init__
_PENDING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("qconv_vllm_embedding", default=None)


def _main_model(prefix: str) -> str:
    return f"{prefix}.embed_tokens" if prefix else "embed_tokens"


def _mtp_predictor(prefix: str) -> str:
    """Qwen3_5MTP builds its predictor under `<p>.mtp` but loads the target's embed_tokens as `<p>.model.embed_tokens`
    (so the artifact's `re:^mtp\\..*` ignore entry, meant for the MTP layers, does not catch it)."""
    head = prefix[: -len("mtp")] if prefix.endswith("mtp") else f"{prefix}."
    return f"{head}model.embed_tokens"


# (patch target of the model's __init__, how its embed_tokens is named) for each vLLM model that builds a bare
# VocabParallelEmbedding
MODELS = (
    ("llama_model_init", _main_model),
    ("qwen3_5_model_init", _main_model),
    ("qwen3_5_mtp_init", _mtp_predictor),
)


def _model_inits() -> list[tuple[str, Callable[[str], str]]]:
    """The targets whose modules import here; a model whose module does not (e.g. Qwen3.5 without torchvision)
    cannot be served by this vLLM either, so it needs no patch."""
    out = []
    for target, name_of in MODELS:
        if patches.importable(target):
            out.append((target, name_of))
        else:
            log.warning("qconv-vllm: %s not patched (its module does not import)", patches.TARGETS[target].attr)
    return out


def _wrap_model_init(target: str, name_of: Callable[[str], str]) -> None:
    orig = patches.current(target)

    @functools.wraps(orig)
    def __init__(self, *args, vllm_config, prefix: str = "", **kwargs):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        qc = vllm_config.quant_config
        token = _PENDING.set((qc, name_of(prefix)) if isinstance(qc, CompressedTensorsConfig) else None)
        try:
            orig(self, *args, vllm_config=vllm_config, prefix=prefix, **kwargs)
        finally:
            _PENDING.reset(token)

    patches.replace(**{target: __init__})


def _wrap_embedding_init() -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    orig = patches.current("embedding_init")

    @functools.wraps(orig)
    def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
        pending = _PENDING.get()
        if pending is not None and type(self) is VocabParallelEmbedding and not args and not kwargs.get("prefix"):
            _PENDING.set(None)  # only the model's own embed_tokens; the reset in the model's __init__ restores
            kwargs["prefix"] = pending[1]
            if kwargs.get("quant_config") is None:
                kwargs["quant_config"] = pending[0]
        orig(self, num_embeddings, embedding_dim, *args, **kwargs)

    patches.replace(embedding_init=__init__)


def _cpu_lookup() -> None:
    """vLLM's lookup kernel is Triton-only; gather and dequantize the rows in torch when the weights are on CPU."""
    orig = patches.current("embedding_lookup")

    @functools.wraps(orig)
    def embedding(self, layer, input_):
        if layer.weight_packed.device.type != "cpu":
            return orig(self, layer, input_)
        ids = input_.reshape(-1).long()
        rows = dequantize_rows(
            layer.weight_packed[ids],
            layer.weight_scale[ids],
            self.num_bits,
            layer.hidden_size,
            layer.weight_scale.dtype,
        )
        return rows.reshape(*input_.shape, layer.hidden_size)

    patches.replace(embedding_lookup=embedding)


def apply() -> list[str]:
    names = []
    for target, name_of in _model_inits():
        _wrap_model_init(target, name_of)
        names.append(f"quantized embed_tokens: {patches.TARGETS[target].attr.split('.')[0]}")
    _wrap_embedding_init()
    _cpu_lookup()
    names.append("quantized embedding lookup on CPU")
    return names
