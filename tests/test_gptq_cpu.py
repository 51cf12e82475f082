"""GPTQ's column sweep on the CPU (qconv/convert/gptq_cpu.py) gives llm-compressor's eager sweep bit for bit, and
llm-compressor's GPTQ reaches it through its own backend table once a build registered it."""

from __future__ import annotations

import pytest
import torch

from qconv.convert import gptq_cpu


def _qargs(symmetric: bool, strategy: str, bits: int = 4, kind: str = "int", actorder=None):
    from compressed_tensors.quantization import QuantizationArgs

    group = {"group_size": 32} if strategy == "group" else {}
    return QuantizationArgs(
        num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy, actorder=actorder, **group
    )


def _problem(batch: int, rows: int, cols: int, qargs, scale_dtype, seed: int = 0):
    """Weights, an upper Cholesky factor of an inverse Hessian (what GPTQ sweeps against), and observer-like
    scales and zero points for `qargs`."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(batch, rows, cols, generator=g)
    a = torch.randn(batch, cols, 2 * cols, generator=g)
    h = a @ a.transpose(1, 2) / cols + 0.1 * torch.eye(cols)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    n = {"group": -(-cols // 32), "channel": 1, "tensor": 1}[qargs.strategy]
    shape = (batch, 1, 1) if qargs.strategy == "tensor" else (batch, rows, n)
    scale = (torch.rand(shape, generator=g) * 0.3 + 0.05).to(scale_dtype)
    zp = None if qargs.symmetric else torch.randint(0, 2**qargs.num_bits, shape, generator=g).to(scale_dtype)
    g_idx = torch.arange(cols, dtype=torch.int) // 32 if qargs.strategy == "group" else None
    return w, hinv, scale, zp, g_idx


def _eager(*args, **kwargs):
    """llm-compressor's own eager sweep, by its name in the backend table."""
    import llmcompressor.modifiers.gptq.gptq_quantize  # noqa: F401 (defines it)
    from compressed_tensors.utils.impl_backend import ImplBackend

    return ImplBackend.call("gptq_block_update", *args, **kwargs)


def _sweep(fn, w, hinv, scale, zp, g_idx, qargs, i1: int = 0):
    w1 = w.clone()
    q1, e1, l1 = torch.zeros_like(w1), torch.zeros_like(w1), torch.zeros_like(w1)
    fn(w1, hinv, q1, e1, l1, scale=scale, zero_point=zp, global_scale=None, g_idx=g_idx, quant_args=qargs, i1=i1)
    return w1, q1, e1, l1


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("strategy", ["group", "channel", "tensor"])
# float32 work with float32 or bf16 scales; bf16 throughout where a streamed build keeps the weight's dtype
@pytest.mark.parametrize(
    "w_dtype, scale_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2]
)
def test_cpu_sweep_gives_the_eager_sweeps_bits(symmetric, strategy, w_dtype, scale_dtype):
    qargs = _qargs(symmetric, strategy)
    w, hinv, scale, zp, g_idx = _problem(2, 48, 64, qargs, scale_dtype)
    w, hinv = w.to(w_dtype), hinv.to(w_dtype)
    eager = _sweep(_eager, w, hinv, scale, zp, g_idx, qargs)
    ours = _sweep(gptq_cpu.block_update, w, hinv, scale, zp, g_idx, qargs)
    for name, a, b in zip(("W1", "Q1", "Err1", "losses1"), eager, ours):
        assert torch.equal(a, b), name
    assert not torch.equal(eager[1], w)  # the sweep did round something


def test_a_block_past_the_first_reads_its_own_groups():
    qargs = _qargs(False, "group")
    w, hinv, scale, zp, g_idx = _problem(1, 16, 128, qargs, torch.float32)
    blk = (w[:, :, 64:], hinv[:, 64:, 64:], scale, zp, g_idx, qargs, 64)
    eager = _sweep(_eager, *blk)
    assert all(torch.equal(a, b) for a, b in zip(eager, _sweep(gptq_cpu.block_update, *blk)))


def test_float_schemes_stay_with_the_librarys_sweep():
    w = torch.zeros(1, 4, 8)
    assert gptq_cpu.usable(w, None, None, None, None, quant_args=_qargs(True, "channel"))
    assert not gptq_cpu.usable(w, None, None, None, None, quant_args=_qargs(True, "channel", 8, "float"))


@pytest.mark.parametrize("actorder", [None, "weight"])
def test_llm_compressors_gptq_reaches_it_and_gets_the_same_weights(monkeypatch, actorder):
    """quantize_weight, llm-compressor's whole GPTQ of a stacked batch of matrices, dispatches to the registered
    sweep on CPU tensors; with every backend off (compressed-tensors' CT_ENFORCE_EAGER) it gives the same result,
    also with the columns in activation order (each batch item its own group index)."""
    from compressed_tensors.utils import impl_backend
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    gptq_cpu.register()
    gptq_cpu.register()  # once per process: a second call adds nothing
    qargs = _qargs(False, "group", actorder=actorder)
    w, _, scale, zp, _ = _problem(2, 24, 96, qargs, torch.float32, seed=1)
    a = torch.randn(2, 96, 300)
    hess = a @ a.transpose(1, 2) / 300
    calls = []
    real = gptq_cpu.block_update
    monkeypatch.setattr(gptq_cpu, "block_update", lambda *x, **k: (calls.append(1), real(*x, **k))[1])
    ours = quantize_weight(w.clone(), hess.clone(), scale, zp, None, qargs, blocksize=32)
    assert len(calls) == 3  # 96 columns in blocks of 32
    monkeypatch.setattr(impl_backend, "ENFORCE_EAGER", True)
    eager = quantize_weight(w.clone(), hess.clone(), scale, zp, None, qargs, blocksize=32)
    assert len(calls) == 3
    assert all(torch.equal(x, y) for x, y in zip(ours, eager))
