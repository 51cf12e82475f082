"""GPTQ's column sweep on the CPU, registered in llm-compressor's own backend table for it (compressed-tensors'
`ImplBackend`, entry point `gptq_block_update`, where its Triton kernel sits for GPUs).

llm-compressor's eager sweep reads and writes one strided column of the [batch, rows, 128] block per step and
goes through compressed-tensors' generic fake-quantize (its range tensors made anew each column). This one does the
same operations in the same order on a transposed copy of the block, where a column is contiguous, with the range
made once: the same bits (tests/test_gptq_cpu.py compares them with the eager sweep), in a fraction of the time
(docs/BENCHMARKS.md, "What the build does faster now"). Integer schemes only; anything else goes on to the
library's own backends."""

from __future__ import annotations

import functools

from qconv.convert import patches

ENTRYPOINT = "gptq_block_update"
PRIORITY = 1  # after llm-compressor's Triton kernel (0), which takes CUDA tensors only


def usable(W1, Hinv1, Q1, Err1, losses1, *, quant_args, **_) -> bool:
    """CPU tensors of an integer scheme (float schemes, FP8 / FP4, keep the library's sweep)."""
    from compressed_tensors.quantization import QuantizationType

    return W1.device.type == "cpu" and W1.dim() == 3 and quant_args.type == QuantizationType.INT


def block_update(W1, Hinv1, Q1, Err1, losses1, *, scale, zero_point, global_scale, g_idx, quant_args, i1) -> None:
    """One GPTQ block, as llm-compressor's eager `gptq_block_update` computes it: W1 [batch, rows, width] swept
    column by column against the inverse-Hessian block Hinv1 [batch, width, width]; Q1, Err1 and losses1 filled."""
    import torch
    from compressed_tensors.quantization.utils import calculate_range
    from llmcompressor.modifiers.gptq.helpers import column_scale_window

    width = W1.shape[-1]
    eff, zp = column_scale_window(
        scale, zero_point, global_scale, g_idx, quant_args, num_rows=W1.shape[-2], i1=i1, i2=i1 + width
    )
    q_min, q_max = calculate_range(quant_args, W1.device)
    # [batch, width, rows]: a column is a contiguous row here; a per-tensor or per-channel scale has width 1
    work = W1.transpose(1, 2).contiguous()
    s_all = eff.transpose(1, 2).contiguous()
    z_in = None if zp is None else zp.to(W1.dtype).transpose(1, 2).contiguous()  # fake_quantize: zp in x's dtype
    z_out = None if zp is None else zp.to(eff.dtype).transpose(1, 2).contiguous()  # and in the scale's to dequantize
    err_dtype = torch.promote_types(torch.promote_types(W1.dtype, eff.dtype), Hinv1.dtype)
    q_all = torch.empty(work.shape, dtype=eff.dtype)
    err_all = torch.empty(work.shape, dtype=err_dtype)
    diag = Hinv1.diagonal(dim1=1, dim2=2)
    per_column = s_all.shape[1] == width
    for i in range(width):
        c = i if per_column else 0
        w, s = work[:, i], s_all[:, c]
        x = w / s
        if z_in is not None:
            x += z_in[:, c]
        q = torch.clamp(x, q_min, q_max).round_().to(s.dtype)
        if z_out is not None:
            q = q - z_out[:, c]
        q = q * s
        err = (w - q) / diag[:, i, None]
        q_all[:, i] = q
        err_all[:, i] = err
        work[:, i:] -= Hinv1[:, i, i:].unsqueeze(-1) * err.unsqueeze(1)
    Q1.copy_(q_all.transpose(1, 2))
    Err1.copy_(err_all.transpose(1, 2))
    losses1.copy_(err_all.square().transpose(1, 2))
    W1.copy_(work.transpose(1, 2))


@functools.cache
def register() -> None:
    """Add the CPU sweep to llm-compressor's backends, once per process (the table is the library's). The entry
    point is checked first, as every patch target is (qconv.convert.patches)."""
    from compressed_tensors.utils.impl_backend import ImplBackend

    patches.current("gptq_block_update")

    def qconv_cpu_gptq_block_update(*args, **kwargs):  # the registry keys backends by name: this one is ours
        return block_update(*args, **kwargs)

    ImplBackend.register(ENTRYPOINT, usable, PRIORITY)(qconv_cpu_gptq_block_update)
