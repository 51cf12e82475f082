"""Quantization through llmcompressor: the layout becomes compressed-tensors config groups (qconv.convert.groups),
GPTQ (or RTN) runs sequentially layer by layer, and the model is saved in compressed form that vLLM and transformers load as is."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from qconv import progress
from qconv.convert import gptq_cpu
from qconv.convert.device import LayerClock
from qconv.convert.groups import config_groups, exact_target
from qconv.convert.oneshot_fixes import (
    autoround_writes_what_it_tuned,
    calibrating_in,
    cpu_awq,
    rotations_offloadable,
    row_blocked_compression,
    sdpa_calibration,
    untie_only_tied,
)
from qconv.convert.shared_inputs import shared_inputs
from qconv.convert.stream import MAX_SHARD_SIZE
from qconv.errors import QconvError
from qconv.manifest import ModuleDecision
from qconv.recipes.recipe import Recipe
from qconv.recipes.sections import KEEP

log = logging.getLogger(__name__)

# Calibration samples per forward: tokens x the model's widest activation at most this many elements (32 MB in
# float32), and at most CALIB_BATCH samples: the 27B's 17,408-wide MLP goes one 2,048-token sample at a time.
CALIB_BATCH_ELEMENTS = 1 << 23
CALIB_BATCH = 16
# Same-shape modules of a layer (q/o, k/v, gate/up) that GPTQ sweeps column by column together on the CPU.
CPU_GPTQ_BATCH = 8


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


def rotation_modifier(recipe: Recipe, rotated: list[str]):
    """llm-compressor's QuIPModifier with input ("v") rotations on exactly `rotated`: the weight side is fused into
    the weights before rounding, the input side stays online (config.json's transform_config; vLLM applies it).
    `precision` is what the online side computes in during the calibration passes (llm-compressor's default,
    float64, is slow on a CPU and on consumer GPUs: docs/BENCHMARKS.md); compressed-tensors fuses the weight side
    in float64 whatever it says, and vLLM turns inputs in the model's dtype."""
    import torch
    from llmcompressor.modifiers.transform import QuIPModifier

    rot = recipe.quantizer.rotation
    assert rot is not None
    return QuIPModifier(
        rotations=["v"],
        transform_type=rot.type,
        transform_block_size=rot.block_size,
        precision=torch.float32,
        targets=[exact_target(n) for n in rotated],
        ignore=[],
    )


def modifiers(
    model,
    recipe: Recipe,
    groups: dict,
    ignore: list[str],
    rotated: list[str] | None = None,
    device: str = "cpu",
) -> list:
    """The llmcompressor recipe: the rotation when the recipe has one (on `rotated`), then RTN, GPTQ, AWQ smoothing
    then GPTQ (llm-compressor's AWQ+GPTQ example), or AutoRound. `device`: where the layers are quantized."""
    first = [rotation_modifier(recipe, rotated)] if rotated else []
    return first + _rounding(model, recipe, groups, ignore, device)


def _rounding(model, recipe: Recipe, groups: dict, ignore: list[str], device: str = "cpu") -> list:
    """actorder is passed to GPTQModifier itself: its default (a sentinel) turns a scheme's null into "static".
    batched_quantization: llm-compressor sweeps same-shape modules of a layer through GPTQ's column loop as one
    batch. Its "auto" sizes batches from free CUDA memory and gives singletons elsewhere; on the CPU the loop's
    cost is per column op, not per element, so a layer's q/o, k/v and gate/up go together there (the same weights:
    each batch member gets its own matrix products)."""
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
        batched_quantization=CPU_GPTQ_BATCH if device == "cpu" else "auto",
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
    rotated: list[str],
    tied: bool = False,
    tokenizer=None,
    device: str = "cpu",
    dtype=None,
    max_shard_size: str = MAX_SHARD_SIZE,
) -> None:
    """Run llmcompressor on `model` in place and save it compressed into `out`. `tokenizer`: handed to oneshot as
    the processor; without one llmcompressor loads the checkpoint's AutoProcessor, which for a vision-language
    model (Qwen3_5ForConditionalGeneration) needs torchvision for its video half, although the calibration data
    are token ids already. `rotated`: the Linears the recipe's rotation turns (qconv.convert.rotation.rotated_modules).
    `device`: where the caller's qconv.convert.device.on_device onloads each layer (here:
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
    fixes = autoround_writes_what_it_tuned() if autoround else contextlib.nullcontext()
    rotations = rotations_offloadable() if recipe.quantizer.rotation else contextlib.nullcontext()
    computing = calibrating_in(model, dtype) if dtype is not None else contextlib.nullcontext()
    gptq_cpu.register()
    with (
        computing,
        sdpa_calibration(),
        shared_inputs(),
        cpu_awq(),
        untie_only_tied(),
        fixes,
        rotations,
        contextlib.closing(clock),
    ):
        oneshot(
            model=model,
            dataset=ds,
            recipe=modifiers(model, recipe, groups, ignore, list(rotated), device),
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
        model.save_pretrained(out, save_compressed=True, max_shard_size=max_shard_size)
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
