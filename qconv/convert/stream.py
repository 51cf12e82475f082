"""RAM-bounded build: decoder layers streamed one at a time from safetensors, never the whole model in memory."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# An in-memory build holds the bf16 model plus GPTQ's float32 work buffers and the calibration activations:
# stream once the model alone would take more than this share of the memory that is free now.
STREAM_FRACTION = 0.5


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def should_stream(source_bytes: int) -> bool:
    ram = available_ram()
    if ram and source_bytes > STREAM_FRACTION * ram:
        log.info("model (%.1f GB bf16) exceeds %.0f%% of free RAM (%.1f GB): streaming the build layer by layer",
                 source_bytes / 1e9, 100 * STREAM_FRACTION, ram / 1e9)
        return True
    return False


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors shard that holds it (from the headers; nothing is read)."""
    from qconv.convert.layout import read_safetensors_header

    return {name: shard for shard in sorted(path.glob("*.safetensors")) for name in read_safetensors_header(shard)}


def load_streamed_model(path: Path, config: dict, offload_dir: Path, dtype: str = "bfloat16"):
    """The source model with every weight left in the source's own safetensors shards.

    The model is built on the meta device and each parameter is registered in compressed-tensors' disk offload
    cache as a link to its tensor in the source shard (no copy, nothing read). llmcompressor's sequential pipeline
    then onloads one decoder layer at a time for calibration and GPTQ, updated tensors are written to the offload
    folder, and compression on save goes module by module: resident memory stays near one layer plus the
    calibration activations. The quantization code is the in-memory build's, so the artifact is the same."""
    import torch
    import transformers
    from compressed_tensors.offload.cache.disk import DiskCache
    from compressed_tensors.offload.module import offload_module

    from qconv.errors import QconvError

    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = cls._from_config(cfg, dtype=getattr(torch, dtype)) if cls else \
            transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.config._name_or_path = str(path)  # llmcompressor copies the MTP head from here on save
    files = tensor_files(path)
    shutil.rmtree(offload_dir, ignore_errors=True)  # links or updates left by a killed run
    offload_dir.mkdir(parents=True)
    log.info("streaming build: weights stay in %s, one layer in memory at a time (offload folder %s)", path, offload_dir)
    for mod_name, module in list(model.named_modules()):
        for buf_name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:  # computed at init, not stored (rotary inv_freq): rebuild the module on the CPU
                parent_name, _, child = mod_name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, type(module)(config=module.config))
                break
    for mod_name, module in list(model.named_modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        for local, p in params.items():
            full = f"{mod_name}.{local}" if mod_name else local
            if full not in files:
                raise QconvError(f"tensor {full} is not in the source safetensors", where=str(path),
                                 fix="stream only complete checkpoints (tied weights: build in memory)")
            DiskCache.create_checkpoint_symlink(p, {"safetensors_file": str(files[full]), "weight_name": full,
                                                    "dtype": str(p.dtype).removeprefix("torch.")}, offload_dir)
        offload_module(module, "cpu", "disk", offload_dir=str(offload_dir))
    return model
