"""W4A8 on named linears only: vLLM 0.32 switches Marlin's int8 input path for every WNA16 linear at once
(VLLM_MARLIN_INPUT_DTYPE=int8; `get_marlin_input_dtype(prefix)` ignores the prefix). With QCONV_VLLM_W4A8 set (a
regex on the module name, written by `qconv serve` from the profile's `w4a8` roles) the compressed-tensors WNA16
scheme gets int8 input only for the modules it matches; without it vLLM's behaviour is unchanged."""

from __future__ import annotations

import functools
import os
import re

from qconv_vllm import patches

ENV = "QCONV_VLLM_W4A8"


def restricted(orig, pattern: str):
    """get_marlin_input_dtype limited to the module names `pattern` matches."""
    rx = re.compile(pattern)

    @functools.wraps(orig)
    def get_marlin_input_dtype(prefix: str | None = None):
        return orig(prefix) if prefix and rx.search(prefix) else None

    return get_marlin_input_dtype


def apply() -> list[str]:
    orig = patches.current("marlin_input_dtype")
    patches.current("wna16_create_weights")  # checked: the scheme still asks by layer name
    pattern = os.environ.get(ENV)
    if not pattern:
        return []
    patches.replace(marlin_input_dtype=restricted(orig, pattern))
    return [f"W4A8 restricted to /{pattern}/"]
