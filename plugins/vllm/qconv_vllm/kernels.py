"""A plain reference kernel for weight-only int Linears (and the quantized lm_head) that vLLM's CPU backend has no
kernel for: its CPUWNA16 kernel takes 4-bit weights with both dimensions a multiple of 32, so an 8-bit lm_head
("Quant type (uint8b128) not supported by CPUWNA16") or a 4-bit layer of an odd width stops the load. Registered
last for the CPU platform through vLLM's own `register_linear_kernel`, so vLLM's kernels keep every layer they
can run; on GPUs Marlin runs W8A16 and this kernel is never chosen. It takes zero points (uint4/uint8 codes with
compressed-tensors' packed `weight_zero_point`) too. vLLM 0.32's CPU wheel builds CPUWNA16's GEMM
(`cpu_gemm_wna16`) into its AVX-512 library only: on an AVX2 CPU that kernel is chosen and then fails at the first
forward, so there the plugin names it in vLLM's own VLLM_DISABLED_KERNELS and this kernel runs the int4 layers. That
GEMM computes bf16 / fp16 only: `qconv serve` disables it the same way where vLLM computes in float32
(qconv.serve.vllm_compute.cpu_kernel_env)."""

from __future__ import annotations

import torch

from qconv_vllm import patches
from qconv_vllm.packing import dequantize_rows


def _kernel_class():
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel, MPLinearLayerConfig
    from vllm.platforms import current_platform

    class QconvReferenceWNA16LinearKernel(MPLinearKernel):
        """Keeps the packed int codes and their scales; dequantizes them to the activation dtype at the first call
        and keeps that dense copy (CPU only, where memory is the host's: a dequantize per call cost more than the
        matmul)."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            if not current_platform.is_cpu():
                return False, "the qconv reference kernel runs on CPU only"
            bits = c.weight_type.size_bits
            if bits not in (2, 4, 8) or c.weight_type.bias != (0 if c.zero_points else 1 << (bits - 1)):
                return False, f"the qconv reference kernel takes 2/4/8-bit ints, not {c.weight_type}"
            k = c.partition_weight_shape[0]
            if c.group_size not in (-1, 0) and k % c.group_size:
                return False, f"group size {c.group_size} does not divide the input size {k}"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            self.in_features = self.config.partition_weight_shape[0]
            self._transform_param(layer, self.w_q_name, lambda p: p.data.contiguous())
            self._transform_param(layer, self.w_s_name, lambda p: p.data.contiguous())
            if self.config.zero_points:
                self._transform_param(layer, self.w_zp_name, lambda p: p.data.contiguous())

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            w = getattr(layer, "qconv_dense_weight", None)
            if w is None or w.dtype != x.dtype:
                w_q, w_s, w_zp = self._get_weight_params(layer)
                w = dequantize_rows(
                    w_q,
                    w_s,
                    self.config.weight_type.size_bits,
                    self.in_features,
                    x.dtype,
                    w_zp if self.config.zero_points else None,
                )
                layer.qconv_dense_weight = w
            return torch.nn.functional.linear(x, w, bias)

    return QconvReferenceWNA16LinearKernel


CPU_WNA16 = "CPUWNA16LinearKernel"


def cpu_wna16_runs() -> bool:
    """Whether this vLLM's CPU library has the GEMM its CPUWNA16 kernel calls (absent from the AVX2 build)."""
    import vllm._custom_ops  # noqa: F401 - loads the platform's _C library and registers its ops

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def disabling_cpu_wna16(disabled: str) -> str:
    """A VLLM_DISABLED_KERNELS value with CPUWNA16 named in it, the entries already there kept (plugin and qconv
    serve both disable it this way)."""
    names = [k for k in disabled.split(",") if k]
    return ",".join(names if CPU_WNA16 in names else [*names, CPU_WNA16])


def apply() -> list[str]:
    import os

    from vllm.platforms import PlatformEnum, current_platform

    patches.current("mp_transform_param"), patches.current("mp_weight_params")  # checked: what the kernel calls
    patches.current("register_linear_kernel")(_kernel_class(), PlatformEnum.CPU, "mp")
    done = ["reference WNA16 kernel (CPU, 2/4/8-bit, zero points)"]
    if current_platform.is_cpu() and not cpu_wna16_runs():
        # vLLM reads it per selection
        os.environ["VLLM_DISABLED_KERNELS"] = disabling_cpu_wna16(os.environ.get("VLLM_DISABLED_KERNELS", ""))
        done.append(f"{CPU_WNA16} disabled (this vLLM CPU build has no cpu_gemm_wna16)")
    return done
