"""KV-cache quantization: KVarN, baselines, the packed store and the memory-fit planner."""

from qconv.kv.schemes import KV_SCHEME_NAMES, get_kv_scheme

__all__ = ["KV_SCHEME_NAMES", "get_kv_scheme"]
