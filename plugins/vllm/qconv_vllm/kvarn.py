"""The `kvarn_*` KV-cache dtypes in stock vLLM 0.32: the places vLLM names cache dtypes one by one, patched.

Pluggable KV-cache dtypes are not a vLLM feature, so the names are added where vLLM enumerates them, each target
checked first (it exists, with the shape these patches were written against) so that a vLLM that moved one fails
at `register()` with its version instead of running without KVarN:
- `vllm.config.cache.CacheDType` (a Literal): CacheConfig's pydantic validator, the `--kv-cache-dtype` choices and
  the attention selector's assertion all read it;
- `vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE`: the storage dtype (bytes);
- the platform's `get_attn_backend_cls`: CPU always answers CPU_ATTN and CUDA's automatic choice never picks
  CUSTOM, so a `kvarn_*` layer is sent to the backend registered under AttentionBackendEnum.CUSTOM."""

from __future__ import annotations

import functools
import inspect
import typing

import torch

from qconv_vllm import KVARN_PRESETS as PRESETS
from qconv_vllm import patches
from qconv_vllm.patches import PatchTargetMoved

BACKEND_MODULE = "qconv_vllm.kvarn_backend"  # one class per preset, named by it


def _require(ok: bool, what: str) -> None:
    if not ok:
        import vllm

        raise PatchTargetMoved(
            f"qconv-vllm KVarN: {what} is not as in vLLM 0.32 (installed: vLLM {vllm.__version__});"
            " install the tested vLLM with `qconv runtime install`"
        )


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def check_targets() -> None:
    """Every target exists with the expected shape (raises PatchTargetMoved naming the first that does not)."""
    from vllm.config import cache
    from vllm.engine import arg_utils
    from vllm.platforms import current_platform
    from vllm.utils import torch_utils
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends import registry

    _require(
        typing.get_origin(getattr(cache, "CacheDType", None)) is typing.Literal,
        "vllm.config.cache.CacheDType (a Literal)",
    )
    _require(
        "cache_dtype" in getattr(cache.CacheConfig, "__dataclass_fields__", {}),
        "CacheConfig.cache_dtype (a pydantic dataclass field)",
    )
    _require(
        getattr(selector, "CacheDType", None) is cache.CacheDType or _is_patched(selector.CacheDType),
        "vllm.v1.attention.selector.CacheDType",
    )
    _require(
        isinstance(getattr(torch_utils, "STR_DTYPE_TO_TORCH_DTYPE", None), dict),
        "vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE",
    )
    _require(
        hasattr(getattr(arg_utils, "_compute_kwargs", None), "cache_clear"),
        "vllm.engine.arg_utils._compute_kwargs (lru-cached)",
    )
    _require(
        _params(registry.register_backend)[:2] == ["backend", "class_path"]
        and hasattr(registry.AttentionBackendEnum, "CUSTOM"),
        "attention backend registry (CUSTOM)",
    )
    _require(
        _params(current_platform.get_attn_backend_cls)[:2] == ["selected_backend", "attn_selector_config"],
        f"{type(current_platform).__name__}.get_attn_backend_cls(selected_backend, attn_selector_config, ...)",
    )


def _is_patched(lit) -> bool:
    return set(PRESETS) <= set(typing.get_args(lit))


def _extend_cache_dtype() -> None:
    import pydantic
    from vllm.config import cache
    from vllm.engine import arg_utils

    if _is_patched(cache.CacheDType):
        return
    lit = typing.Literal[typing.get_args(cache.CacheDType) + PRESETS]  # type: ignore[valid-type]
    patches.replace(cache_dtype=lit, selector_cache_dtype=lit)
    cache.CacheConfig.__annotations__["cache_dtype"] = lit
    cache.CacheConfig.__dataclass_fields__["cache_dtype"].type = lit
    pydantic.dataclasses.rebuild_dataclass(cache.CacheConfig, force=True)
    arg_utils._compute_kwargs.cache_clear()


def _route_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, f"{BACKEND_MODULE}.{PRESETS[0]}")  # --attention-backend CUSTOM
    orig = patches.current("attn_backend_cls")
    if getattr(orig, "_qconv_kvarn", False):
        return

    @functools.wraps(orig)
    def get_attn_backend_cls(selected_backend, attn_selector_config, *args, **kwargs):
        dtype = attn_selector_config.kv_cache_dtype
        if isinstance(dtype, str) and dtype.startswith("kvarn_") and not attn_selector_config.use_mla:
            return f"{BACKEND_MODULE}.{dtype}"
        return orig(selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._qconv_kvarn = True
    patches.replace(attn_backend_cls=staticmethod(get_attn_backend_cls))


def apply() -> list[str]:
    check_targets()
    from vllm.utils import torch_utils

    _extend_cache_dtype()
    for name in PRESETS:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(name, torch.uint8)
    _route_backend()
    return ["kvarn-kv-cache"]
