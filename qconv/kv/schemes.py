"""Registry of KV-cache schemes by name (the names recipes' `kv_cache` and `qconv eval --kv` use)."""

from __future__ import annotations

import re

from qconv.errors import QconvError
from qconv.kv.base import KVScheme
from qconv.kv.baselines import BF16, FP8, IntGroup, kivi
from qconv.kv.kvarn import kvarn
from qconv.recipes.sections import KV_SCHEMES
from qconv_vllm.features import KVARN_PRESETS

_KVARN = re.compile(r"kvarn_k(\d+)v(\d+)_g(\d+)")


def _runnable(name: str) -> KVScheme:
    """A scheme a recipe's profile may run, from its name (recipes own that list: they validate profiles)."""
    if name == "bf16":
        return BF16(name)
    if name == "fp8_e4m3":
        return FP8(name)
    k, v, g = map(int, _KVARN.fullmatch(name).groups())  # type: ignore[union-attr]  (the names are ours)
    return kvarn(k, v, g)


_SCHEMES: dict[str, KVScheme] = {
    s.name: s
    for s in (
        *map(_runnable, KV_SCHEMES),
        IntGroup("int8_token", bits=8),  # simulated by `qconv eval --kv` only
        IntGroup("int4_g32", bits=4, group=32),
        kivi(4, 4),
        kivi(4, 2),
        kivi(2, 2),
    )
}
KV_SCHEME_NAMES = tuple(_SCHEMES)
# The KVarN presets the qconv-vllm plugin serves inside vLLM (its FEATURES name them as `kv-cache:<preset>`).
VLLM_PLUGIN_KVARN = KVARN_PRESETS
# What runs each KV cache on a GPU card; a scheme missing here runs in qconv's own engine only, on the CPU.
GPU_RUNTIME = {"bf16": "vLLM", "fp8_e4m3": "vLLM", **{k: "vLLM + the qconv-vllm plugin" for k in VLLM_PLUGIN_KVARN}}
NO_GPU_RUNTIME = "no GPU runtime runs it (qconv's own engine only, on the CPU)"


def get_kv_scheme(name: str) -> KVScheme:
    if name not in _SCHEMES:
        raise QconvError(f"unknown KV scheme {name!r}", where="--kv", fix=f"use one of {', '.join(KV_SCHEME_NAMES)}")
    return _SCHEMES[name]
