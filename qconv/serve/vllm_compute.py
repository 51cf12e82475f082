"""What vLLM computes in on each platform (`--compute-dtype`), and the kernels that dtype needs on vLLM's CPU
backend."""

from __future__ import annotations

import os

from qconv.errors import QconvError


def cpu_kernel_env(dtype: str | None, platform: str | None) -> dict[str, str]:
    """vLLM computing in float32 on a CPU: its int4 kernel (CPUWNA16), whose GEMM computes bf16 / fp16 only and is
    chosen for a float32 model all the same ("not implemented for 'Float'" at the first forward), disabled in vLLM's
    own VLLM_DISABLED_KERNELS, so the plugin's reference kernel runs those layers as it does where it is absent."""
    if platform != "cpu" or dtype not in ("float32", "float"):
        return {}
    from qconv_vllm.kernels import disabling_cpu_wna16

    return {"VLLM_DISABLED_KERNELS": disabling_cpu_wna16(os.environ.get("VLLM_DISABLED_KERNELS", ""))}


def vllm_dtype(choice: str, platform: str | None, hybrid: bool = False) -> str | None:
    """vLLM's --dtype for --compute-dtype: float32 or bfloat16 as asked; `auto` is float32 on a CPU that emulates
    bf16 (vLLM's CPU backend would compute the bf16 model in bf16, several times slower there; the int weights are
    the same, the KV cache of a non-KVarN profile is then float32), else None: the model's own dtype. vLLM's CPU
    Gated-DeltaNet kernel takes bf16 only, so a hybrid model stays bf16 there."""
    from qconv.compute import bf16_native, dtype_name, resolve

    dtype = resolve(choice, "cpu")  # refuses an unknown choice on any platform
    if choice == "auto":
        return "float32" if platform == "cpu" and not hybrid and not bf16_native("cpu") else None
    if platform == "cpu" and hybrid and choice != "bfloat16":
        raise QconvError(
            f"--compute-dtype {choice}: vLLM's CPU backend runs Gated-DeltaNet layers in bf16 only",
            where="--compute-dtype",
            fix="use auto or bfloat16 for this model on a CPU, or --backend native",
        )
    return dtype_name(dtype)


def user_dtype(extra_args: list[str]) -> str | None:
    """The --dtype the user's arguments after `--` give vLLM (the last one wins, as in argparse), else None."""
    found = None
    for i, a in enumerate(extra_args):
        if a == "--dtype" and i + 1 < len(extra_args):
            found = extra_args[i + 1]
        elif a.startswith("--dtype="):
            found = a.split("=", 1)[1]
    return found
