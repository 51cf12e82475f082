"""Every private function of llmcompressor, compressed-tensors and transformers that qconv replaces, in one table,
and the one way to replace them (`swap`).

Each replacement was read against the library's source of the tested release series (`TESTED`) and assumes the
target's parameters (`Target.params`). `swap` checks the target exists with those parameters, and the library's
series, before it patches anything: a moved or changed target stops the build with the library's version, where it
would otherwise run without the patch (other weights, or a large model out of memory). Where a library offers a
public way, qconv takes it instead (llmcompressor's `oneshot(processor=...)`, compressed-tensors' offload API in
convert/stream.py, its backend table for GPTQ's column sweep in convert/gptq_cpu.py: such a target is `registered`,
checked alike but never swapped). The replacements themselves live with the code they serve (convert/stream.py,
convert/oneshot_fixes.py, convert/shared_inputs.py, convert/hfmodel.py, convert/gguf.py); tests/test_patches.py
proves each one is still called by the library."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from qconv.errors import QconvError

# Library release series (major.minor) whose source the replacements were read against. transformers is checked by
# signature only: its range is wide and the one patch into it guards a branch of `_init_weights`.
TESTED = {"llmcompressor": ("0.14",), "compressed-tensors": ("0.19",)}
UNTESTED_ENV = "QCONV_ALLOW_UNTESTED_LIBS"


@dataclass(frozen=True)
class Target:
    package: str  # the distribution, for its version in errors
    module: str
    attr: str  # dotted inside the module: "IntermediatesCache._offload_value"
    params: tuple[str, ...] | None  # the parameter names the replacement takes; None: a value, not a function
    used_by: str  # which qconv function replaces it, and why (see there)
    registered: bool = False  # not replaced: qconv adds a backend to the library's own table for it (checked alike)


_LC, _CT = "llmcompressor", "compressed-tensors"
_GPTQ, _CACHE = "llmcompressor.modifiers.gptq", "llmcompressor.pipelines.cache"
_AR = "llmcompressor.modifiers.autoround.base"
TARGETS = {
    "mse_error": Target(
        _LC,
        "llmcompressor.observers.mse_quant",
        "_calculate_error",
        ("observed", "args", "token_args", "shrinked_min", "shrinked_max", "norm"),
        "convert.stream.row_blocked_observer: the MSE scale search a block of rows at a time",
    ),
    "gptq_quantize_weight": Target(
        _LC,
        f"{_GPTQ}.base",
        "quantize_weight",
        ("weights", "hessians", "scale", "zero_point", "global_scale", "quant_args", "blocksize", "percdamp"),
        "convert.stream.row_blocked_gptq: GPTQ on blocks of output rows",
    ),
    "gptq_prepare_batch": Target(
        _LC,
        f"{_GPTQ}.base",
        "prepare_batch",
        ("batch", "batch_qparams", "hessians_by_module", "num_samples_by_module"),
        "convert.stream.row_blocked_gptq: weights stacked in their own dtype",
    ),
    "gptq_factorize_hessian": Target(
        _LC,
        f"{_GPTQ}.gptq_quantize",
        "factorize_hessian",
        ("weights", "hessians", "percdamp", "used_rtn_fallback"),
        "convert.stream.row_blocked_gptq: the Hessian factorized once per matrix",
    ),
    "gptq_activation_ordering": Target(
        _LC,
        f"{_GPTQ}.gptq_quantize",
        "apply_activation_ordering",
        ("weights", "hessians", "actorder"),
        "convert.stream.row_blocked_gptq: the act-order permutation once per matrix",
    ),
    "gptq_precision": Target(
        _LC,
        f"{_GPTQ}.helpers",
        "GPTQ_PRECISION",
        None,
        "convert.stream.row_blocked_gptq: prepare_batch's stacking dtype",
    ),
    "gptq_block_update": Target(
        _LC,
        f"{_GPTQ}.gptq_quantize",
        "gptq_block_update",
        ("W1", "Hinv1", "Q1", "Err1", "losses1", "scale", "zero_point", "global_scale", "g_idx", "quant_args", "i1"),
        "convert.gptq_cpu.register: GPTQ's column sweep on the CPU, a backend in the library's ImplBackend table",
        registered=True,
    ),
    "gptq_accumulate_hessian": Target(
        _LC,
        f"{_GPTQ}.base",
        "accumulate_hessian",
        ("inp", "module", "hessian", "num_samples"),
        "convert.shared_inputs.shared_inputs: one X·Xᵀ per input tensor for the Linears that read it",
    ),
    "hadamard_forward": Target(
        _CT,
        "compressed_tensors.transform.factory.hadamard",
        "HadamardTransform.forward",
        ("self", "value"),
        "convert.shared_inputs.shared_inputs: one rotation per input tensor for the Linears that read it",
    ),
    "offload_value": Target(
        _LC,
        _CACHE,
        "IntermediatesCache._offload_value",
        ("value", "offload_device", "onload_device"),
        "convert.stream.activations_on_disk: calibration activations in files",
    ),
    "onload_value": Target(
        _LC,
        _CACHE,
        "IntermediatesCache._onload_value",
        ("intermediate",),
        "convert.stream.activations_on_disk: read back from those files",
    ),
    "pin_memory": Target(
        _LC,
        _CACHE,
        "IntermediatesCache.pin_memory",
        ("self", "batch_index", "input_names"),
        "convert.oneshot_fixes.cpu_awq: AWQ on a torch without an accelerator",
    ),
    "autoround_match": Target(
        _LC,
        _AR,
        "match_named_modules",
        ("model", "targets", "ignore", "fused", "warn_on_fail"),
        "convert.oneshot_fixes.autoround_writes_what_it_tuned: targets matched by full module name inside a layer",
    ),
    "autoround_postprocess": Target(
        _LC,
        _AR,
        "AutoRoundModifier._postprocess_qparams",
        ("self", "model", "llmc_registered_qparams"),
        "convert.oneshot_fixes.autoround_writes_what_it_tuned: AutoRound's zero points written back",
    ),
    "transform_offloaded_device": Target(
        _CT,
        "compressed_tensors.transform.factory.hadamard",
        "get_offloaded_device",
        ("module", "default"),
        "convert.oneshot_fixes.rotations_offloadable: a rotation block built beside a disk-offloaded Linear",
    ),
    "untie_word_embeddings": Target(
        _LC,
        "llmcompressor.modifiers.quantization.quantization.mixin",
        "untie_word_embeddings",
        ("model",),
        "convert.oneshot_fixes.untie_only_tied: separate tables are not cloned",
    ),
    "naive_quantize": Target(
        _CT,
        "compressed_tensors.compressors.naive_quantized.base",
        "quantize",
        ("x", "scale", "zero_point", "args", "dtype", "global_scale"),
        "convert.oneshot_fixes.row_blocked_compression: quantized for saving a block at a time",
    ),
    "packed_quantize": Target(
        _CT,
        "compressed_tensors.compressors.pack_quantized.base",
        "quantize",
        ("x", "scale", "zero_point", "args", "dtype", "global_scale"),
        "convert.oneshot_fixes.row_blocked_compression: the same for packed formats",
    ),
    "pack_to_int32": Target(
        _CT,
        "compressed_tensors.compressors.pack_quantized.base",
        "pack_to_int32",
        ("value", "num_bits", "packed_dim"),
        "convert.oneshot_fixes.row_blocked_compression: packed a block of rows at a time",
    ),
    "sequential_main_device": Target(
        _LC,
        "llmcompressor.pipelines.sequential.pipeline",
        "get_main_device",
        (),
        "convert.device.onload_device: each layer onloaded to the build's --device",
    ),
    "data_free_main_device": Target(
        _LC,
        "llmcompressor.pipelines.data_free.pipeline",
        "get_main_device",
        (),
        "convert.device.onload_device: the same for round-to-nearest recipes",
    ),
    "eager_attention": Target(
        _LC,
        "llmcompressor.utils.helpers",
        "use_eager_attention",
        ("model",),
        "convert.oneshot_fixes.sdpa_calibration: the calibration passes' attention through torch's SDPA",
    ),
    "init_weights": Target(
        "transformers",
        "transformers",
        "PreTrainedModel._init_weights",
        ("self", "module"),
        "convert.hfmodel._compressed_embeddings_loadable: a packed embed_tokens loads",
    ),
    "gguf_reader": Target(
        "gguf",
        "gguf",
        "GGUFReader",
        ("path", "mode"),
        "convert.gguf.one_parse: transformers' GGUF loader takes one parsed file for every pass of an import",
    ),
    "gguf_tensor_name_map": Target(
        "gguf",
        "gguf",
        "get_tensor_name_map",
        ("arch", "n_blocks"),
        "convert.gguf.one_parse: one tensor-name map per architecture and depth for every module of an import",
    ),
}


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def check_version(package: str, installed: str) -> None:
    """Stop on a library series the replacements were not read against (QCONV_ALLOW_UNTESTED_LIBS=1 tries it)."""
    tested = TESTED.get(package)
    if not tested or ".".join(installed.split("+")[0].split(".")[:2]) in tested or os.environ.get(UNTESTED_ENV) == "1":
        return
    raise QconvError(
        f"qconv replaces private functions of {package} {', '.join(s + '.x' for s in tested)}, but "
        f"{package} {installed} is installed",
        where=package,
        fix=f"pip install '{package}=={tested[-1]}.*' (the version pyproject.toml pins), or set "
        f"{UNTESTED_ENV}=1 to try this one anyway",
    )


def _locate(name: str):
    """(owner, attribute name, the raw current value: a classmethod stays a classmethod) of a target, checked."""
    t = TARGETS[name]
    installed = _version(t.package)
    check_version(t.package, installed)
    where = f"{t.module}.{t.attr}"

    def changed(what: str) -> QconvError:
        return QconvError(
            f"{where} {what} in {t.package} {installed}: qconv patches it ({t.used_by})",
            where=where,
            fix=f"install the {t.package} version pyproject.toml pins, or update "
            f"qconv/convert/patches.py and {t.used_by.split(':')[0]} for this one",
        )

    try:
        owner = importlib.import_module(t.module)
    except ImportError as e:
        raise changed(f"cannot be imported ({e})") from e
    *path, attr = t.attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise changed("no longer exists")
    raw = owner.__dict__.get(attr) if inspect.isclass(owner) else getattr(owner, attr, None)
    if raw is None:
        raise changed("no longer exists")
    if t.params is not None:
        try:
            params = tuple(inspect.signature(getattr(owner, attr)).parameters)
        except (TypeError, ValueError) as e:
            raise changed(f"is not a function ({e})") from e
        if params != t.params:
            raise changed(f"takes ({', '.join(params)}), not ({', '.join(t.params)})")
    return owner, attr, raw


def current(name: str):
    """A target's present value, checked (a classmethod comes as the classmethod object: call `.__func__(cls, ...)`)."""
    return _locate(name)[2]


def check_all() -> list[str]:
    """Check every target of an installed library (a build calls this before any work); returns their names. An
    optional extra's target (gguf) is checked when the code that needs it swaps it."""
    names = [n for n, t in TARGETS.items() if _version(t.package) != "not installed"]
    for name in names:
        _locate(name)
    return names


@contextlib.contextmanager
def swap(**replacements):
    """Replace the named targets (keys of TARGETS) for the duration of the block, every target checked before the
    first is touched; the originals come back on exit, also on error."""
    located = [(_locate(name), new) for name, new in replacements.items()]
    for (owner, attr, _), new in located:
        setattr(owner, attr, new)
    try:
        yield
    finally:
        for (owner, attr, raw), _ in reversed(located):
            setattr(owner, attr, raw)
