"""The dtype model arithmetic runs in: bf16 where the hardware computes it, float32 where torch would emulate it.

On an AVX2-only CPU torch has no native bf16 path: a bf16 forward is several times slower than float32, and a
bf16 backward tens of times (docs/BENCHMARKS.md, "Compute dtype"). The build's sensitivity, its self-generated
calibration and the evaluation's forwards therefore run such a CPU's bf16 weights in float32: the weights are the
same numbers (bf16 -> float32 is exact), only the arithmetic is wider."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from qconv.errors import QconvError

HALF = (torch.bfloat16, torch.float16)
CHOICES = ("auto", "float32", "bfloat16")  # --compute-dtype on build and eval
# --cpu-isa avx2: torch's, oneDNN's and MKL's AVX2 kernels on any x86 CPU, so that float sums come out as an AVX2-only
# CPU makes them (read by each library when it first computes, so set before torch runs anything).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def bf16_native(device: str = "cpu") -> bool:
    """This device computes bf16 natively: a CUDA GPU, or a CPU with oneDNN's bf16 path (AVX512-BW/VL/DQ,
    AVX-NE-CONVERT, AMX)."""
    if str(device).startswith("cuda"):
        return True
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def compute_dtype(device: str = "cpu") -> torch.dtype:
    """bf16 where `device` computes it natively, else float32."""
    return torch.bfloat16 if bf16_native(device) else torch.float32


def resolve(choice: str | None, device: str = "cpu") -> torch.dtype:
    """--compute-dtype: `auto` (or None) is bf16 where `device` computes it natively (a GPU, an AVX-512 bf16 / AMX
    CPU), else float32; `float32` or `bfloat16` is taken as given, on any device."""
    choice = (choice or "auto").lower()
    if choice not in CHOICES:
        raise QconvError(
            f"unknown compute dtype {choice!r}", where="--compute-dtype", fix=f"use one of {', '.join(CHOICES)}"
        )
    return compute_dtype(device) if choice == "auto" else getattr(torch, choice)


def limit_cpu_isa(isa: str) -> None:
    """--cpu-isa: `native` leaves the kernels to the CPU; `avx2` makes an AVX-512 host compute as an AVX2-only one
    does, its artifacts then rebuildable bit for bit there. Refused where the libraries have already computed."""
    if isa == "native":
        return
    was = {k: os.environ.get(k) for k in AVX2_ENV}
    os.environ.update(AVX2_ENV)
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or bf16_native("cpu"):
        for k, v in was.items():  # refused: the environment this process hands its children stays as it was
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        raise QconvError(
            f"--cpu-isa {isa} did not take effect: torch computes with {torch.backends.cpu.get_cpu_capability()} "
            "kernels (they were chosen before qconv could ask, or this CPU has no AVX2)",
            where="--cpu-isa",
            fix="set " + " ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) + " in the environment instead",
        )


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16: the spelling config.json, our records and the CLI use."""
    return str(dtype).removeprefix("torch.")


def _half_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype in HALF and t.device.type != "meta":
            yield t


def upcast(model: torch.nn.Module, dtype: torch.dtype) -> dict[int, torch.dtype]:
    """Run `model`'s half-precision parameters and buffers in `dtype` from now on (nothing when `dtype` is a half
    type); returns what each changed tensor was, for `restore`. Float32 buffers (rotary frequencies) stay as
    they are, which `model.to(dtype)` would not guarantee."""
    was: dict[int, torch.dtype] = {}
    if dtype in HALF:
        return was
    for t in _half_tensors(model):
        was[id(t)] = t.dtype
        t.data = t.data.to(dtype)
    return was


def restore(model: torch.nn.Module, was: dict[int, torch.dtype]) -> None:
    """Undo `upcast` (exact: a half value survives the round trip through float32)."""
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in was:
            t.data = t.data.to(was[id(t)])


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype):
    """`model` runs in `dtype` for the block, in its own dtypes again after it."""
    was = upcast(model, dtype)
    try:
        yield model
    finally:
        restore(model, was)
