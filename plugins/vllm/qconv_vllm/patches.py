"""Every vLLM internal the plugin replaces, adds to or relies on, in one table, and the one way to replace them
(`replace`).

Each patch was read against vLLM's source of the tested series (qconv_vllm.TESTED) and assumes its target's
parameters (`Target.params`) or code (`Target.reads`). `register()` checks every target (`check_all`) before the
first patch: a patch release that moved or changed one stops vLLM at start-up with the vLLM version and the target,
where it would otherwise load a model with the wrong weights, fail deep inside model loading, or run silently
without the patch. The replacements live with the code they serve (embedding.py, tied_head.py, rotation.py,
kvarn.py, w4a8.py); kernels.py and stretch.py use vLLM's public hooks and only rely on the entries marked so.
tests/test_patches.py proves each replacement is still called by vLLM."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


class PatchTargetMoved(RuntimeError):
    pass


PATCHED = "_qconv_vllm_patch"  # set on each replacement function: the target it replaced


@dataclass(frozen=True)
class Target:
    module: str
    attr: str  # dotted inside the module: "LlamaModel.__init__" ("current_platform.__class__.x" walks attributes)
    params: tuple[str, ...] | None  # the parameter names the replacement takes; None: a value, not a function
    used_by: str  # which plugin module patches it (or relies on it), and why
    reads: str = ""  # code the target's source must contain (spaces ignored): a call the plugin relies on
    added: bool = False  # an attribute the plugin adds: its owner must exist, the attribute need not
    optional: bool = False  # a model module that may not import (then this vLLM cannot serve that model either)
    relied_on: bool = False  # checked only: the plugin calls or subclasses it, and replaces nothing
    # checked where it is used, not by check_all at register(): its module loads numba, and llvmlite's objects in
    # sys.modules break vLLM's start-up scan for Triton kernels (triton_utils.dispatcher) on CPU
    at_use: bool = False


_EMB = "vllm.model_executor.layers.vocab_parallel_embedding"
_CT_EMB = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding"
_MODEL_INIT = ("self", "args", "vllm_config", "prefix", "kwargs")
_MPK = "vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel"
_WNA16 = "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16"
TARGETS = {
    "llama_model_init": Target(
        "vllm.model_executor.models.llama", "LlamaModel.__init__", _MODEL_INIT, "embedding: embed_tokens named"
    ),
    "qwen3_5_model_init": Target(
        "vllm.model_executor.models.qwen3_5",
        "Qwen3_5Model.__init__",
        _MODEL_INIT,
        "embedding: embed_tokens named, with the quant config",
        optional=True,
    ),
    "qwen3_5_mtp_init": Target(
        "vllm.model_executor.models.qwen3_5_mtp",
        "Qwen3_5MultiTokenPredictor.__init__",
        _MODEL_INIT,
        "embedding: the MTP predictor's embed_tokens named as the target's",
        optional=True,
    ),
    "embedding_init": Target(
        _EMB,
        "VocabParallelEmbedding.__init__",
        ("self", "num_embeddings", "embedding_dim", "params_dtype", "org_num_embeddings", "padding_size")
        + ("quant_config", "prefix", "disable_tp", "reduce_results", "quant_method", "parallel_group"),
        "embedding: a bare embed_tokens gets its prefix and quant config",
    ),
    "embedding_lookup": Target(
        _CT_EMB,
        "CompressedTensorsEmbeddingWNA16Int.embedding",
        ("self", "layer", "input_"),
        "embedding: a torch lookup on CPU (vLLM's is Triton-only)",
    ),
    "tie_weights": Target(
        _EMB, "ParallelLMHead.tie_weights", ("self", "embed_tokens"), "tied_head: the head is the packed embedding"
    ),
    "packed_head_apply": Target(
        _CT_EMB,
        "CompressedTensorsEmbeddingWNA16Int.apply",
        ("self", "layer", "args", "kwargs"),
        "tied_head: logits from the packed table (vLLM's apply raises)",
    ),
    "hadamard_cpu_linear": Target(
        "vllm.model_executor.layers.quantization.compressed_tensors.transform.module",
        "HadamardTransform.cpu_linear",
        None,
        "rotation: the rotation's GEMM on CPU",
        added=True,
    ),
    "cpu_gemm": Target(
        "vllm.model_executor.layers.utils",
        "cpu_unquantized_gemm",
        ("layer", "x", "weight", "bias"),
        "rotation: the CPU GEMM calls the layer's cpu_linear",
        reads="layer.cpu_linear(x, weight, bias)",
        relied_on=True,
    ),
    "register_linear_kernel": Target(
        "vllm.model_executor.kernels.linear",
        "register_linear_kernel",
        ("kernel_class", "platform", "kernel_type"),
        "kernels: the reference WNA16 kernel registered for CPU",
        relied_on=True,
    ),
    "mp_transform_param": Target(
        _MPK, "MPLinearKernel._transform_param", ("self", "layer", "name", "fn"), "kernels: subclassed", relied_on=True
    ),
    "mp_weight_params": Target(
        _MPK, "MPLinearKernel._get_weight_params", ("self", "layer"), "kernels: subclassed", relied_on=True
    ),
    "cache_dtype": Target("vllm.config.cache", "CacheDType", None, "kvarn: the kvarn_* names added"),
    "selector_cache_dtype": Target("vllm.v1.attention.selector", "CacheDType", None, "kvarn: the same, as imported"),
    "str_dtype_to_torch": Target(
        "vllm.utils.torch_utils", "STR_DTYPE_TO_TORCH_DTYPE", None, "kvarn: storage dtype", relied_on=True
    ),
    "attn_backend_cls": Target(
        "vllm.platforms",
        "current_platform.__class__.get_attn_backend_cls",
        ("selected_backend", "attn_selector_config", "num_heads"),
        "kvarn: kvarn_* layers sent to the plugin's backend",
    ),
    "marlin_input_dtype": Target(
        _WNA16,
        "get_marlin_input_dtype",
        ("prefix",),
        "w4a8: Marlin's int8 input for the named modules only",
    ),
    "wna16_create_weights": Target(
        _WNA16,
        "CompressedTensorsWNA16.create_weights",
        None,
        "w4a8: the scheme picks Marlin's input dtype by layer name",
        reads="get_marlin_input_dtype(self.layer_name)",
        relied_on=True,
    ),
    "runner_propose": Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.propose_draft_token_ids",
        None,
        "stretch: the runner's custom_class proposer call",
        reads="cast(Any, self.drafter).propose(sampled_token_ids, self.input_batch.num_tokens_no_spec, "
        "self.input_batch.token_ids_cpu, slot_mappings=slot_mappings,",
        relied_on=True,
        at_use=True,
    ),
    "api_server_run": Target(
        "vllm.entrypoints.launchers.api_server.entry",
        "run_server",
        ("args", "uvicorn_kwargs"),
        "frontdoor: qconv's connection limits reach vLLM's uvicorn as options",
        relied_on=True,
        at_use=True,
    ),
    "api_server_uvicorn": Target(
        "vllm.entrypoints.launchers.launcher",
        "serve_http",
        ("app", "sock", "enable_ssl_refresh", "peer_loads", "uvicorn_kwargs"),
        "frontdoor: the options become uvicorn's Config",
        reads="config = uvicorn.Config(app, **uvicorn_kwargs)",
        relied_on=True,
        at_use=True,
    ),
    "ngram_match": Target(
        "vllm.v1.spec_decode.ngram_proposer",
        "_find_longest_matched_ngram_and_propose_tokens",
        ("origin_tokens", "min_ngram", "max_ngram", "max_model_len", "k"),
        "stretch: vLLM's n-gram matcher drafts",
        relied_on=True,
        at_use=True,
    ),
}


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def moved(name: str, what: str) -> PatchTargetMoved:
    t = TARGETS[name]
    return PatchTargetMoved(
        f"qconv-vllm: {t.module}.{t.attr} {what} in vLLM {_vllm_version()}: the plugin relies on it ({t.used_by}). "
        "Install the tested vLLM with `qconv runtime install` (vLLM 0.32.x), or update "
        "plugins/vllm/qconv_vllm/patches.py for this vLLM"
    )


def importable(name: str) -> bool:
    """Whether an optional target's module imports here (a model that does not is not patched: see `optional`)."""
    try:
        importlib.import_module(TARGETS[name].module)
    except ImportError:
        return False
    return True


def _unwrap(fn):
    return getattr(fn, "py_func", fn)  # a numba-compiled function: its Python source and signature


def _locate(name: str):
    """(owner, attribute name, current value or None where the plugin adds it) of a target, checked."""
    t = TARGETS[name]
    try:
        owner = importlib.import_module(t.module)
    except ImportError as e:
        raise moved(name, f"cannot be imported ({e})") from e
    *path, attr = t.attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise moved(name, "no longer exists")
    value = inspect.getattr_static(owner, attr, None) if inspect.isclass(owner) else getattr(owner, attr, None)
    if value is None:
        if t.added:
            return owner, attr, None
        raise moved(name, "no longer exists")
    current = _unwrap(getattr(owner, attr))
    if getattr(current, PATCHED, None) == name:
        return owner, attr, getattr(owner, attr)  # the plugin's own replacement, checked when it went in
    if t.params is not None:
        try:
            params = tuple(inspect.signature(current).parameters)
        except (TypeError, ValueError) as e:
            raise moved(name, f"is not a function ({e})") from e
        if params != t.params:
            raise moved(name, f"takes ({', '.join(params)}), not ({', '.join(t.params)})")
    if t.reads and "".join(t.reads.split()) not in "".join(inspect.getsource(current).split()):
        raise moved(name, f"no longer calls `{t.reads}`")
    return owner, attr, getattr(owner, attr)


def current(name: str):
    """A target's present value as vLLM reads it (a method bound to its class), checked; None for an added one not
    yet there."""
    return _locate(name)[2]


def check_all(with_at_use: bool = False) -> list[str]:
    """Check every target (register() calls this before any patch); returns their names. An optional target whose
    module does not import is skipped, and `at_use` ones are checked by their user (with_at_use: here too)."""
    names = [n for n, t in TARGETS.items() if with_at_use or not t.at_use]
    for name in names:
        if not (TARGETS[name].optional and not importable(name)):
            _locate(name)
    return names


def replace(**replacements) -> None:
    """Put each value in place of the named target (keys of TARGETS, not `relied_on` ones), every target checked
    before the first is touched. For the life of the process: vLLM reads these at start-up and per request."""
    for name in replacements:
        if TARGETS[name].relied_on:
            raise ValueError(f"{name} is relied on, not replaced")
    located = [(name, _locate(name), new) for name, new in replacements.items()]
    for name, (owner, attr, _), new in located:
        if TARGETS[name].params is not None:
            setattr(getattr(new, "__func__", new), PATCHED, name)
        setattr(owner, attr, new)
