"""Quantization through llmcompressor: the plan becomes compressed-tensors config groups, GPTQ (or RTN) runs
sequentially layer by layer, and the model is saved in compressed form that vLLM and transformers load as is."""

from __future__ import annotations

import contextlib
import logging
import re
from collections import defaultdict
from pathlib import Path

from qconv import progress
from qconv.compute import HALF, upcast
from qconv.convert import patches
from qconv.convert.device import LayerClock
from qconv.convert.stream import MAX_SHARD_SIZE
from qconv.errors import QconvError
from qconv.manifest import ModuleDecision
from qconv.models.family import all_role_patterns
from qconv.recipes.recipe import Recipe
from qconv.recipes.sections import KEEP

log = logging.getLogger(__name__)

_PATTERN = dict(all_role_patterns())
COMPRESS_BLOCK_ELEMENTS = 1 << 26  # rows quantized for saving at a time: 256 MB per float32 temporary
# Calibration samples per forward: tokens x the model's widest activation at most this many elements (32 MB in
# float32), and at most CALIB_BATCH samples: the 27B's 17,408-wide MLP goes one 2,048-token sample at a time.
CALIB_BATCH_ELEMENTS = 1 << 23
CALIB_BATCH = 16


def _role_target(role: str) -> str:
    """A role's name pattern as a compressed-tensors / vLLM target (both use re.match, anchored at the start)."""
    pat = _PATTERN[role]
    if pat.startswith("^"):
        return "re:" + pat
    if pat.startswith("(^|\\.)"):
        return "re:(.*\\.)?" + pat[len("(^|\\.)") :]
    return "re:.*" + pat


def _exact(name: str) -> str:
    return "re:^" + re.escape(name) + "$"


def _key(m: ModuleDecision) -> tuple:
    return (m.scheme, m.bits, m.group_size, m.symmetric, _format(m))


def _format(m: ModuleDecision) -> str | None:
    """Weight-only int groups (4- and 8-bit, Linear layers, embed_tokens and lm_head alike) are `pack-quantized`:
    the one form vLLM's compressed-tensors parser takes for WNA16 (Marlin on GPUs; its embedding method for
    embed_tokens). Weight+activation schemes (w8a8) stay `int-quantized`."""
    if m.scheme == KEEP:
        return None
    if m.scheme.endswith("a16"):
        return "pack-quantized"
    return "int-quantized"


def config_groups(modules: list[ModuleDecision], recipe: Recipe) -> tuple[dict, list[str]]:
    """compressed-tensors config groups + ignore list. A role whose modules all share one decision is targeted by
    its role regex (a short config for a 64-layer model); otherwise by exact module names."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    by_role: dict[str, set] = defaultdict(set)
    for m in modules:
        by_role[m.role].add(_key(m))
    targets: dict[tuple, list[str]] = defaultdict(list)
    for m in modules:
        if m.scheme == KEEP:
            continue
        if len(by_role[m.role]) == 1:
            t = _role_target(m.role)
            if t not in targets[_key(m)]:
                targets[_key(m)].append(t)
        else:
            targets[_key(m)].append(_exact(m.name))
    # one label, one scheme but for group_size and symmetric (validated), which the decisions carry
    schemes = {s.label: s for s in recipe.schemes.values()}
    groups = {}
    for i, (key, tg) in enumerate(sorted(targets.items(), key=lambda kv: str(kv[0]))):
        label, bits, g, sym, fmt = key
        s = schemes[label]
        w = s.weights
        wargs = QuantizationArgs(
            num_bits=bits,
            type="int",
            symmetric=sym,
            strategy=w.strategy,
            group_size=g if w.strategy == "group" else None,
            observer=recipe.quantizer.observer,
        )
        aargs = None
        if s.activations:
            a = s.activations
            aargs = QuantizationArgs(
                num_bits=a.bits, type="int", symmetric=a.symmetric, strategy=a.strategy, dynamic=a.dynamic
            )
        groups[f"group_{i}"] = QuantizationScheme(targets=tg, weights=wargs, input_activations=aargs, format=fmt)
    ignore = ["re:^mtp\\..*"]  # vLLM must leave the MTP head unquantized; transformers never builds it
    for role in sorted({m.role for m in modules if m.scheme == KEEP} - {"mtp"}):
        if all(m.scheme == KEEP for m in modules if m.role == role):
            ignore.append(_role_target(role))
        else:
            ignore.extend(_exact(m.name) for m in modules if m.role == role and m.scheme == KEEP)
    return groups, ignore


def calibrate_embeddings(model, head: bool = False) -> None:
    """GPTQ only calibrates Linear layers; give quantized embeddings round-to-nearest qparams from their weights.
    `head`: the output head too. AutoRound tunes the decoder layers only and leaves a separate head's qparams as
    initialized (a NaN head)."""
    import torch
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization.utils import calculate_qparams

    out_head = model.get_output_embeddings() if head else None
    for name, mod in model.named_modules():
        if not (isinstance(mod, torch.nn.Embedding) or mod is out_head) or not hasattr(mod, "quantization_scheme"):
            continue
        args = mod.quantization_scheme.weights
        w = mod.weight.detach()  # min/max in its own dtype are exact: no float32 copy of a 248,320-row table
        g = args.group_size if args.strategy == "group" else w.shape[1]
        wg = w.view(w.shape[0], w.shape[1] // g, g)
        scale, zp = calculate_qparams(wg.amin(-1).float(), wg.amax(-1).float(), args)
        # update_offload_parameter also writes through to a disk-offloaded (streamed) module
        update_offload_parameter(mod, "weight_scale", scale.view_as(mod.weight_scale).to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            update_offload_parameter(
                mod, "weight_zero_point", zp.view_as(mod.weight_zero_point).to(mod.weight_zero_point.dtype)
            )
        log.info("%s: round-to-nearest int%d g%d qparams", name, args.num_bits, g)


@contextlib.contextmanager
def _autoround_writes_what_it_tuned():
    """llm-compressor 0.14's AutoRoundModifier matches the recipe's targets against names relative to one decoder
    layer ("mlp.down_proj"), so a target naming one module of the model ("re:^model.layers.3.mlp.down_proj$", how a
    selection names its units) matches nothing there: every unit is tuned with the first config group's scheme and
    writing its scales back fails. Targets are matched by the module's full name instead (the modifier records it
    as `_tmp_name`). It also copies AutoRound's scales back but not its zero points (unsigned, 0..2^b-1), which
    compressed-tensors stores signed: they are written back shifted by 2^(b-1), the same integers."""
    import torch
    from compressed_tensors.utils.match import is_match

    postprocess = patches.current("autoround_postprocess")

    def by_full_name(model, targets, ignore=None, fused=None, warn_on_fail=False):
        for name, module in model.named_modules():
            full = getattr(module, "_tmp_name", name)
            if any(is_match(full, module, t, fused=fused) for t in targets or ()) and not is_match(
                full, module, ignore or [], fused=fused
            ):
                yield name, module

    def with_zero_points(self, model, llmc_registered_qparams):
        for name, module in model.named_modules():
            scheme, zp = getattr(module, "quantization_scheme", None), getattr(module, "zp", None)
            ref = llmc_registered_qparams.get(name, {}).get("weight_zero_point")
            if ref is None or not isinstance(zp, torch.Tensor) or scheme is None or scheme.weights.symmetric:
                continue
            signed = zp.float().round() - 2 ** (scheme.weights.num_bits - 1)
            value = signed.to(ref.dtype).to(ref.device).reshape(ref.shape)
            module.register_parameter("weight_zero_point", torch.nn.Parameter(value, requires_grad=False))
            del module.zp
        return postprocess(self, model, llmc_registered_qparams)

    with patches.swap(autoround_match=by_full_name, autoround_postprocess=with_zero_points):
        yield


@contextlib.contextmanager
def _rotations_offloadable():
    """compressed-tensors 0.19's Hadamard factory creates a rotation block on the device its Linear is offloaded to,
    and a streamed build offloads to "disk", which is no torch device: the block (b x b) is created on the CPU
    instead; registering it on the Linear then offloads it like the Linear's own weights."""
    offloaded = patches.current("transform_offloaded_device")

    def on_a_device(module, default=None):
        device = offloaded(module, default)
        return "cpu" if device == "disk" else device

    with patches.swap(transform_offloaded_device=on_a_device):
        yield


@contextlib.contextmanager
def _computing_in(model, dtype):
    """GPTQ's calibration passes in `dtype` (float32 where a CPU emulates bf16: several times faster there), the
    model saved in its own dtypes after: the half parameters it had go back by name (GPTQ replaces some), and the
    quantization scales llmcompressor made beside them take that half dtype too, as a half-precision run makes
    them. A disk-offloaded (streamed) model computes in its own dtype."""
    import torch

    half = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype in HALF}
    if dtype in HALF or not half or any(t.device.type == "meta" for t in model.parameters()):
        yield
        return
    upcast(model, dtype)
    try:
        yield
    finally:
        to = next(iter(half.values()))
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dtype == torch.float32 and (name in half or name.endswith("_scale")):
                t.data = t.data.to(half.get(name, to))


def calibration_batch(calib_ids: list[list[int]], width: int) -> int:
    """Samples per calibration forward. One at a time runs a layer's many small ops once per sample; samples of one
    length go through together (llmcompressor's default collator truncates a batch to its shortest sample, so
    samples of several lengths go one at a time). The Hessians sum the same products either way. `width`: the
    model's widest activation (hidden or MLP size)."""
    lengths = {len(x) for x in calib_ids}
    if len(lengths) != 1:
        return 1
    return max(1, min(len(calib_ids), CALIB_BATCH, CALIB_BATCH_ELEMENTS // (lengths.pop() * max(1, width))))


def _widest(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max(getattr(text, "hidden_size", 0) or 0, getattr(text, "intermediate_size", 0) or 0)


def sequential_targets(model) -> list[str]:
    """llmcompressor's own layer targets (the model's no-split modules) plus the embedding and the lm_head, each a
    subgraph of its own: llmcompressor keeps a subgraph's modules onloaded until its GPTQ is done, so otherwise a
    248,320-row table sits in memory while the first or last decoder layer runs GPTQ (2.5 GB each for the 27B)."""
    from llmcompressor.utils.pytorch.module import get_no_split_params

    return [*get_no_split_params(model), "re:(.*\\.)?embed_tokens$", "re:(.*\\.)?lm_head$"]


@contextlib.contextmanager
def _untie_only_tied():
    """llmcompressor unties the embeddings (clones both tables) whenever a scheme targets one, also when they are
    separate already: for the 27B two 2.5 GB copies in memory, written again to a streamed build's offload folder,
    for the same values. Separate tables are left as they are."""
    untie = patches.current("untie_word_embeddings")

    def only_tied(model):
        i, o = model.get_input_embeddings(), model.get_output_embeddings()
        if i is None or o is None or i.weight is o.weight:
            return untie(model)
        model.config.tie_word_embeddings = False

    with patches.swap(untie_word_embeddings=only_tied):
        yield


@contextlib.contextmanager
def row_blocked_compression(block_elements: int = COMPRESS_BLOCK_ELEMENTS):
    """compressed-tensors quantizes a weight for saving through float32 temporaries of the whole matrix, several
    at once (5 GB each for a 248,320 x 5,120 lm_head), and packs it through int32 ones. With per-row scales
    (channel or group strategy) rows are independent, so blocks of rows are quantized and packed into one output
    instead: the same integers, the same packed words."""
    import torch

    whole, pack = patches.current("naive_quantize"), patches.current("pack_to_int32")

    def blocked_pack(value, num_bits, packed_dim=1):  # packing runs along each row: rows are independent
        step = max(1, block_elements // max(1, value.shape[-1]))
        if value.dim() != 2 or packed_dim != 1 or value.shape[0] <= step:
            return pack(value, num_bits, packed_dim)
        return torch.cat([pack(value[a : a + step], num_bits, 1) for a in range(0, value.shape[0], step)])

    def blocked(x, scale, zero_point, args, dtype=None, global_scale=None):
        step = max(1, block_elements // max(1, x.shape[-1]))
        if x.dim() != 2 or x.shape[0] <= step or args.strategy not in ("channel", "group") or global_scale is not None:
            return whole(x, scale, zero_point, args, dtype, global_scale)
        out = None
        for a in range(0, x.shape[0], step):
            sl = slice(a, a + step)
            q = whole(x[sl], scale[sl], None if zero_point is None else zero_point[sl], args, dtype)
            if out is None:
                out = torch.empty(x.shape, dtype=q.dtype, device=q.device)
            out[sl] = q
        return out

    with patches.swap(naive_quantize=blocked, packed_quantize=blocked, pack_to_int32=blocked_pack):
        yield


def awq_mappings(model) -> list:
    """llmcompressor's own AWQ smoothing mappings for this architecture (its static or dynamic registry). It falls
    back to llama-style names for an unknown class without a word; here that is an error, not a guess."""
    from llmcompressor.modifiers.transform.awq import (
        AWQ_DYNAMIC_MAPPING_REGISTRY,
        AWQ_MAPPING_REGISTRY,
    )
    from llmcompressor.modifiers.transform.awq.dynamic_mappings import (
        get_layer_mappings_from_model,
    )

    arch = type(model).__name__
    if arch not in AWQ_MAPPING_REGISTRY and arch not in AWQ_DYNAMIC_MAPPING_REGISTRY:
        raise QconvError(
            f"llmcompressor has no AWQ smoothing mappings for {arch}",
            where="quantizer.algorithm",
            fix="use algorithm gptq for this model",
        )
    return get_layer_mappings_from_model(model)


@contextlib.contextmanager
def _cpu_awq():
    """llmcompressor 0.14's AWQ pins its cached activations for faster host-to-device copies, which raises "Cannot
    access accelerator device" on a CPU-only torch; without an accelerator there is nothing to copy to, so skip it."""
    import torch

    if torch.accelerator.is_available():
        yield
        return
    with patches.swap(pin_memory=lambda self, batch_index, input_names=None: None):
        yield


def rotated_modules(modules: list[ModuleDecision], recipe: Recipe) -> list[str]:
    """The Linears the recipe's rotation turns: every quantized Linear of its roles whose in_features the rotation's
    block divides; none without a rotation."""
    rot = recipe.quantizer.rotation
    if rot is None:
        return []
    out, skipped = [], []
    for m in modules:
        if m.scheme == KEEP or m.role not in rot.roles:
            continue
        (out if m.shape[-1] % rot.block_size == 0 else skipped).append(m.name)
    if skipped:
        log.info("rotation: block %d does not divide %d Linears' inputs, left unrotated", rot.block_size, len(skipped))
    return out


def rotation_modifier(recipe: Recipe, rotated: list[str]):
    """llm-compressor's QuIPModifier with input ("v") rotations on exactly `rotated`: the weight side is fused into
    the weights before rounding, the input side stays online (config.json's transform_config; vLLM applies it)."""
    from llmcompressor.modifiers.transform import QuIPModifier

    rot = recipe.quantizer.rotation
    assert rot is not None
    return QuIPModifier(
        rotations=["v"],
        transform_type=rot.type,
        transform_block_size=rot.block_size,
        targets=[_exact(n) for n in rotated],
        ignore=[],
    )


def modifiers(model, recipe: Recipe, groups: dict, ignore: list[str], rotated: list[str] | None = None) -> list:
    """The llmcompressor recipe: the rotation when the recipe has one (on `rotated`), then RTN, GPTQ, AWQ smoothing
    then GPTQ (llm-compressor's AWQ+GPTQ example), or AutoRound."""
    first = [rotation_modifier(recipe, rotated)] if rotated else []
    return first + _rounding(model, recipe, groups, ignore)


def _rounding(model, recipe: Recipe, groups: dict, ignore: list[str]) -> list:
    """actorder is passed to GPTQModifier itself: its default (a sentinel) turns a scheme's null into "static"."""
    import torch
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    q = recipe.quantizer
    if q.algorithm == "autoround":
        from llmcompressor.modifiers.autoround import AutoRoundModifier

        # torch.compile of the tuning loop: no gain for a CPU build's few layers, and a compiler a CPU host may lack
        return [
            AutoRoundModifier(
                config_groups=groups,
                ignore=ignore,
                iters=q.iters,
                batch_size=q.batch_size,
                enable_torch_compile=torch.cuda.is_available(),
            )
        ]
    if not q.gptq:
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    gptq = GPTQModifier(
        config_groups=groups,
        ignore=ignore,
        block_size=q.block_size,
        dampening_frac=q.dampening_frac,
        actorder=q.actorder,
    )
    if q.algorithm == "awq+gptq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(mappings=awq_mappings(model)), gptq]
    return [gptq]


def quantize(
    model,
    modules: list[ModuleDecision],
    recipe: Recipe,
    calib_ids: list[list[int]],
    out: Path,
    *,
    untie: bool,
    seed: int,
    tied: bool = False,
    tokenizer=None,
    device: str = "cpu",
    dtype=None,
) -> None:
    """Run llmcompressor on `model` in place and save it compressed into `out`. `tokenizer`: handed to oneshot as
    the processor; without one llmcompressor loads the checkpoint's AutoProcessor, which for a vision-language
    model (Qwen3_5ForConditionalGeneration) needs torchvision for its video half, although the calibration data
    are token ids already. `device`: where the caller's qconv.convert.device.on_device onloads each layer (here:
    what the per-layer progress reports). `dtype`: what the calibration passes compute in (qconv.compute; float32
    where bf16 is emulated), the weights and their scales saved in their own dtype either way."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot

    torch.manual_seed(seed)
    if untie:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    groups, ignore = config_groups(modules, recipe)
    if not groups:
        log.info("recipe quantizes nothing: saving as is")
        model.save_pretrained(out, safe_serialization=True)
        return
    max_len = max(len(x) for x in calib_ids)
    ds = Dataset.from_dict({"input_ids": calib_ids, "attention_mask": [[1] * len(x) for x in calib_ids]})
    linear = sum(1 for m in modules if m.scheme != KEEP and m.role != "embed")  # embeddings: round-to-nearest
    log.info(
        "quantization: %s on %d modules, layer by layer, %d calibration samples",
        recipe.quantizer.algorithm.upper(),
        linear,
        len(calib_ids),
        extra=progress.total(linear),
    )
    clock = LayerClock(model, device)
    autoround = recipe.quantizer.algorithm == "autoround"
    fixes = _autoround_writes_what_it_tuned() if autoround else contextlib.nullcontext()
    rotations = _rotations_offloadable() if recipe.quantizer.rotation else contextlib.nullcontext()
    computing = _computing_in(model, dtype) if dtype is not None else contextlib.nullcontext()
    with computing, _cpu_awq(), _untie_only_tied(), fixes, rotations, contextlib.closing(clock):
        oneshot(
            model=model,
            dataset=ds,
            recipe=modifiers(model, recipe, groups, ignore, rotated_modules(modules, recipe)),
            max_seq_length=max_len,
            num_calibration_samples=len(calib_ids),
            # AutoRound tunes on the samples one at a time (auto-round exits on a batched llmcompressor model)
            batch_size=1 if autoround else calibration_batch(calib_ids, _widest(model.config)),
            pipeline="sequential" if recipe.quantizer.calibrated else "datafree",
            sequential_targets=sequential_targets(model),
            processor=tokenizer,
            shuffle_calibration_samples=False,
        )
        calibrate_embeddings(model, head=autoround)
    with row_blocked_compression():
        model.save_pretrained(out, save_compressed=True, max_shard_size=MAX_SHARD_SIZE)
    if tied:
        keep_tied(out)


def keep_tied(out: Path) -> None:
    """llmcompressor unties embeddings it quantizes and saves the (unquantized) head beside the packed table; a
    recipe that keeps them tied stores one copy: drop `lm_head.weight` and mark the config tied again, so
    transformers and qconv's engine build the head from the dequantized embed_tokens."""
    import json

    from safetensors.torch import load_file, save_file

    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        if tensors.pop("lm_head.weight", None) is not None:
            save_file(tensors, shard, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].pop("lm_head.weight", None)
        index.write_text(json.dumps(data, indent=2))
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"]["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
