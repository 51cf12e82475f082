"""Input rotations (compressed-tensors transforms) on vLLM's CPU backend.

vLLM 0.32 applies a `random-hadamard` input rotation with `dispatch_unquantized_gemm()`, which on the CPU platform is
`cpu_unquantized_gemm(layer, x, weight, bias)` and calls `layer.cpu_linear`: an attribute vLLM sets up only for its
own unquantized Linear layers, never for the `HadamardTransform` module, so the first forward of a rotated artifact
fails ("'HadamardTransform' object has no attribute 'cpu_linear'"). The rotation gets plain torch's linear there;
GPUs take vLLM's default GEMM and never read the attribute."""

from __future__ import annotations

import torch


def apply() -> list[str]:
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform

    if not hasattr(HadamardTransform, "cpu_linear"):
        HadamardTransform.cpu_linear = staticmethod(torch.nn.functional.linear)
    return ["input rotations on CPU (HadamardTransform.cpu_linear)"]
