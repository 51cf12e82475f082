"""RAM-bounded build: decoder layers streamed one at a time from safetensors, never the whole model in memory."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from qconv import progress
from qconv.compute import dtype_name
from qconv.convert import patches
from qconv.memory import available_ram, pin_mmap_threshold
from qconv.models.family import Family, family_for, layer_index

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# An in-memory build holds the bf16 model plus GPTQ's float32 work buffers and the calibration activations:
# stream once the model alone would take more than this share of the memory that is free now.
STREAM_FRACTION = 0.5
# Largest float32 working block of one GPTQ call: a 65,536 x 2,048 lm_head would otherwise hold its weight in fp32
# plus an error-propagation product of the same size at once (a 248,320 x 5,120 head: ~10 GB).
GPTQ_BLOCK_BYTES = 64 << 20
# Safetensors shard bound of the saved model: save_pretrained holds one shard's tensors in memory while writing it
# (llmcompressor's default, 20 GB, is one shard = the whole compressed model).
MAX_SHARD_SIZE = "512MB"
# Calibration activations at least this large go to disk in a streamed build (activations_on_disk); the rest (masks,
# position ids, rotary tables shared by every sample) stay in memory.
SPILL_MIN_BYTES = 1 << 20


def should_stream(source_bytes: int, compute: torch.dtype | None = None) -> bool:
    """Whether the whole model would take more than STREAM_FRACTION of free RAM in the dtype its whole-model stages
    compute in (qconv.compute: its bf16 weights become float32, twice the bytes, on a CPU without native bf16)."""
    import torch

    compute = compute or torch.bfloat16
    held = source_bytes * compute.itemsize // 2
    ram = available_ram()
    if ram and held > STREAM_FRACTION * ram:
        log.info(
            "model (%.1f GB in %s) exceeds %.0f%% of free RAM (%.1f GB): streaming the build layer by layer",
            held / 1e9,
            dtype_name(compute),
            100 * STREAM_FRACTION,
            ram / 1e9,
        )
        return True
    return False


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors shard that holds it (from the headers; nothing is read)."""
    from qconv.convert.layout import read_safetensors_header

    return {name: shard for shard in sorted(path.glob("*.safetensors")) for name in read_safetensors_header(shard)}


def rebuild_meta_buffers(model, family: Family) -> None:
    """Modules of a meta-device model whose buffers are computed at init, not stored (rotary inv_freq), rebuilt
    on the CPU from their config; the ones that cannot be made again from a config (a scaled embedding) the
    model's family puts back (`Family.restore_buffers`)."""
    for mod_name, module in list(model.named_modules()):
        if any(buf.is_meta for buf in module.buffers(recurse=False)):
            if family.restore_buffers(module):
                continue
            parent_name, _, child = mod_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, type(module)(config=module.config))


def load_streamed_model(path: Path, config: dict, offload_dir: Path, dtype: str = "bfloat16"):
    """The source model with every weight left in the source's own safetensors shards.

    The model is built on the meta device and each parameter is registered in compressed-tensors' disk offload
    cache as a link to its tensor in the source shard (no copy, nothing read). llmcompressor's sequential pipeline
    then onloads one decoder layer at a time for calibration and GPTQ (large matrices in row blocks, see
    row_blocked_gptq), updated tensors are written to the offload folder, compression on save goes module by module
    (compressed tensors go back to the offload folder) and save_pretrained reads one shard of at most
    MAX_SHARD_SIZE back at a time: resident memory stays near one layer plus the calibration activations. The
    quantization code is the in-memory build's, so the artifact is the same."""
    import torch
    import transformers
    from compressed_tensors.offload.cache.disk import DiskCache
    from compressed_tensors.offload.module import offload_module

    from qconv.errors import QconvError

    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = (
            cls._from_config(cfg, dtype=getattr(torch, dtype))
            if cls
            else transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        )
    model.config._name_or_path = str(path)  # llmcompressor copies the MTP head from here on save
    files = tensor_files(path)
    shutil.rmtree(offload_dir, ignore_errors=True)  # links or updates left by a killed run
    offload_dir.mkdir(parents=True)
    log.info(
        "streaming build: weights stay in %s, one layer in memory at a time (offload folder %s)", path, offload_dir
    )
    if not pin_mmap_threshold():
        log.warning("could not pin the C library's mmap threshold: freed memory may not return to the system")
    rebuild_meta_buffers(model, family_for(config.get("model_type", ""), config.get("architectures"), str(path)))
    for mod_name, module in list(model.named_modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        for local, p in params.items():
            full = f"{mod_name}.{local}" if mod_name else local
            if full not in files:
                raise QconvError(
                    f"tensor {full} is not in the source safetensors",
                    where=str(path),
                    fix="stream only complete checkpoints (tied weights: build in memory)",
                )
            DiskCache.create_checkpoint_symlink(
                p,
                {
                    "safetensors_file": str(files[full]),
                    "weight_name": full,
                    "dtype": dtype_name(p.dtype),
                },
                offload_dir,
            )
        offload_module(module, "cpu", "disk", offload_dir=str(offload_dir))
    return model


class Spilled:
    """One calibration activation in a file of its own (raw bytes), deleted when the cache drops the value."""

    def __init__(self, t, folder: Path):
        import tempfile
        import weakref

        import torch

        t = t.detach().to("cpu").contiguous()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        fd, path = tempfile.mkstemp(dir=folder, suffix=".act")
        with open(fd, "wb") as f:
            f.write(memoryview(t.view(torch.uint8).numpy()))
        weakref.finalize(self, Path(path).unlink, missing_ok=True)
        self.path = path

    def load(self):
        """Read into fresh memory (a mapping of the file would count as resident for as long as it is held)."""
        import numpy as np
        import torch

        return torch.from_numpy(np.fromfile(self.path, dtype=np.uint8)).view(self.dtype).view(self.shape)


@contextlib.contextmanager
def activations_on_disk(folder: Path, min_bytes: int = SPILL_MIN_BYTES):
    """Keep llmcompressor's calibration activations in files under `folder` instead of in memory.

    Its sequential pipeline holds, between two layers, every calibration sample's hidden states in an
    IntermediatesCache on the CPU: samples x seq_len x hidden (128 x 2,048 x 5,120 in bf16 is 2.7 GB), growing with
    the sample count. Here each tensor of at least `min_bytes` goes to a file when the pipeline stores it and is
    read back when the next layer takes it, so what stays resident is the sample in flight (offload, not
    recompute: each layer's outputs are computed once, as in memory, and the weights come out the same)."""
    from llmcompressor.pipelines.cache import IntermediateValue

    offload, onload = patches.current("offload_value"), patches.current("onload_value")

    def spill(cls, value, offload_device, onload_device=None):
        import torch

        if (
            isinstance(value, torch.Tensor)
            and value.nbytes >= min_bytes
            and offload_device is not None
            and torch.device(offload_device).type == "cpu"
        ):
            return IntermediateValue(value=Spilled(value, folder), device=onload_device or value.device)
        return offload.__func__(cls, value, offload_device, onload_device)

    def unspill(cls, intermediate):
        if isinstance(intermediate.value, Spilled):
            return intermediate.value.load().to(intermediate.device)
        return onload.__func__(cls, intermediate)

    folder.mkdir(parents=True, exist_ok=True)
    with patches.swap(offload_value=classmethod(spill), onload_value=classmethod(unspill)):
        yield


@contextlib.contextmanager
def row_blocked_observer(block_bytes: int = GPTQ_BLOCK_BYTES):
    """llmcompressor's MSE scale search fake-quantizes the whole weight once per candidate shrink, in float32
    temporaries of the whole matrix (several of 5 GB for a 248,320 x 5,120 lm_head). The error it compares is per
    output row (and group), so each candidate's error is computed a block of rows at a time and concatenated: the
    same errors, the same chosen scales, the early stop still decided over the whole matrix."""
    import torch

    whole = patches.current("mse_error")

    def blocked(observed, args, token_args, lo, hi, norm):
        rows = observed.shape[1] if observed.dim() >= 3 and lo.dim() >= 1 and lo.shape[0] == observed.shape[1] else 0
        step = max(1, block_bytes // (4 * max(1, observed.numel() // max(rows, 1))))
        if rows <= step:
            return whole(observed, args, token_args, lo, hi, norm)
        return torch.cat(
            [
                whole(observed[:, a : a + step], args, token_args, lo[a : a + step], hi[a : a + step], norm)
                for a in range(0, rows, step)
            ]
        )

    with patches.swap(mse_error=blocked):
        yield


def _permute_in_place(h, perm, block_bytes: int):
    """h[b] = h[b][perm[b]][:, perm[b]] with one extra matrix at a time (gathering both axes at once holds two)."""
    step = max(1, block_bytes // (4 * h.shape[-1]))
    for b in range(h.shape[0]):
        p = h[b].index_select(0, perm[b])
        for r0 in range(0, p.shape[0], step):
            p[r0 : r0 + step] = p[r0 : r0 + step].index_select(1, perm[b])
        h[b].copy_(p)


def _rows(t, sl: slice, rows: int):
    return t[:, sl] if t is not None and t.dim() >= 2 and t.shape[1] == rows else t


@contextlib.contextmanager
def row_blocked_gptq(block_bytes: int = GPTQ_BLOCK_BYTES, names: dict | None = None):
    """Run llmcompressor's GPTQ on blocks of output rows. GPTQ quantizes each row on its own against the shared
    Hessian (the error of a column is propagated along the row), so blocks of rows give the same weights while the
    float32 work buffers shrink from the whole matrix to one block. The act-order permutation and the factorization
    depend on the Hessian alone, so they are computed for the first block, in place in the stacked Hessian
    llmcompressor hands over as disposable, and reused by the others: no block copies the Hessian (1.2 GB for a
    17,408-wide down_proj), and a 17,408-wide Cholesky inverse, which costs more than a block's column sweep on a
    CPU, runs once.

    llmcompressor also stacks every weight it quantizes into a float32 copy before GPTQ starts (prepare_batch):
    for a 248,320 x 5,120 lm_head that is 5.1 GB next to the 2.5 GB bf16 weight, and the bf16 cast of the result
    another 2.5 GB. Here the stack stays in the weight's own dtype and each row block goes to float32 only while
    GPTQ works on it; the result is written back in that dtype, the cast llmcompressor would make anyway (the same
    bits). Its Hessian stack (the accumulated sum, its normalized copy and the stack of those) becomes the sum
    normalized in place. Each batch handed over advances the build's progress bar (`names`: module -> its name in
    the model, for the bar's note)."""
    import torch

    whole, prepare = patches.current("gptq_quantize_weight"), patches.current("gptq_prepare_batch")
    factorize = patches.current("gptq_factorize_hessian")

    def blocked(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize=128, percdamp=0.01):
        batch, rows, cols = weights.shape
        step = max(1, block_bytes // (4 * batch * cols))
        if rows <= step and weights.dtype == torch.float32:
            return whole(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize, percdamp)
        losses, fallback, memo = 0, None, {}

        def order_once(w, h, actorder):
            if not actorder:
                return w, h, None
            if "perm" not in memo:
                memo["perm"] = torch.argsort(torch.diagonal(h, dim1=-2, dim2=-1), dim=-1, descending=True)
                _permute_in_place(h, memo["perm"], block_bytes)
            perm = memo["perm"]
            return torch.gather(w, -1, perm.unsqueeze(-2).expand(-1, w.shape[1], -1)), h, perm

        def factorize_once(w, h, damp, used_rtn_fallback):
            if "hinv" not in memo:  # the dead columns (zero Hessian diagonal) GPTQ zeroes in each block
                memo["dead"] = torch.diagonal(h, dim1=-2, dim2=-1) == 0
                memo["hinv"] = factorize(w, h, damp, used_rtn_fallback)
                memo["fallback"] = used_rtn_fallback.clone()
                return memo["hinv"]
            w.masked_fill_(memo["dead"].unsqueeze(1), 0)
            used_rtn_fallback.copy_(memo["fallback"])
            return memo["hinv"]

        with patches.swap(gptq_factorize_hessian=factorize_once, gptq_activation_ordering=order_once):
            for r0 in range(0, rows, step):
                sl = slice(r0, min(r0 + step, rows))
                q, loss, fb = whole(
                    weights[:, sl].float(),
                    hessians,
                    _rows(scale, sl, rows),
                    _rows(zero_point, sl, rows),
                    global_scale,
                    quant_args,
                    blocksize,
                    percdamp,
                )
                weights[:, sl] = q.to(weights.dtype)
                losses, fallback = losses + loss, fb if fallback is None else fallback | fb
        return weights, losses, fallback

    def lean_prepare(batch, batch_qparams, hessians_by_module, samples_by_module):
        name = (names or {}).get(batch[-1], "")
        layer = layer_index(name)
        log.info(
            "GPTQ: %d module(s), %s",
            len(batch),
            name or "unnamed",
            extra=progress.advance(len(batch), f"layer {layer}" if layer is not None else name),
        )
        stacked = None
        for i, module in enumerate(batch):
            h = hessians_by_module.pop(module)
            h.div_(samples_by_module.pop(module).to(device=h.device))
            if len(batch) == 1:
                stacked = h.unsqueeze(0)
            else:
                if stacked is None:
                    stacked = torch.empty((len(batch), *h.shape), dtype=h.dtype, device=h.device)
                stacked[i] = h
            del h
        # GPTQ_PRECISION is read by prepare_batch for the stacked weights only; the Hessians are already stacked:
        # prepare_batch gets one-element stand-ins
        with patches.swap(gptq_precision=batch[0].weight.dtype):
            out = prepare(
                batch, batch_qparams, {m: torch.ones(1, 1) for m in batch}, {m: torch.ones(()) for m in batch}
            )
        return (out[0], stacked, *out[2:])

    with patches.swap(gptq_quantize_weight=blocked, gptq_prepare_batch=lean_prepare):
        yield
