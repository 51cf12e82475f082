"""The words qconv and the plugin share: the feature tokens an artifact's qconv.json `requires` names and the plugin
announces, and the KVarN presets it serves inside vLLM.

Defined here only. The plugin is installed into vLLM's own environment without qconv, so qconv reads these from
this module (qconv's distribution carries the qconv_vllm package: pyproject.toml) instead of keeping a copy."""

from __future__ import annotations

QUANTIZED_EMBEDDINGS = "quantized-embeddings"
TIED_QUANTIZED_HEAD = "quantized-tied-head"
WNA16_8BIT_CPU = "wna16-8bit-cpu"
ROTATIONS_CPU = "input-rotations-cpu"
KV_PREFIX = "kv-cache:"
# The g256 tiles do not split into whole bytes per token at head_dim 64, so vLLM's per-token page sizing cannot hold
# them: they run in qconv's own engine only.
KVARN_PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
FEATURES = (
    QUANTIZED_EMBEDDINGS,
    TIED_QUANTIZED_HEAD,
    WNA16_8BIT_CPU,
    ROTATIONS_CPU,
    *(KV_PREFIX + name for name in KVARN_PRESETS),
)
