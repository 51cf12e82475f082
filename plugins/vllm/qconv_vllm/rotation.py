"""Input rotations (compressed-tensors transforms) on vLLM's CPU backend.

vLLM 0.32 applies a `random-hadamard` input rotation with `dispatch_unquantized_gemm()`, which on the CPU platform is
`cpu_unquantized_gemm(layer, x, weight, bias)` and calls `layer.cpu_linear`: an attribute vLLM sets up only for its
own unquantized Linear layers, never for the `HadamardTransform` module, so the first forward of a rotated artifact
fails ("'HadamardTransform' object has no attribute 'cpu_linear'"). The rotation gets plain torch's linear there;
GPUs take vLLM's default GEMM and never read the attribute."""

from __future__ import annotations

import torch

from qconv_vllm import patches


def apply() -> list[str]:
    patches.current("cpu_gemm")  # checked: vLLM's CPU GEMM still calls layer.cpu_linear(x, weight, bias)
    if patches.current("hadamard_cpu_linear") is None:
        patches.replace(hadamard_cpu_linear=staticmethod(torch.nn.functional.linear))
    return ["input rotations on CPU (HadamardTransform.cpu_linear)"]
