"""Loading a source model or an artifact into transformers, for the places that need transformers' own modules
(calibration, reference logits, comparisons)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path


@contextlib.contextmanager
def _compressed_embeddings_loadable():
    """transformers 5.17's `_init_weights` reads `nn.Embedding.weight` without the None guard it has for Linear
    layers; a pack-quantized embed_tokens has `weight_packed` / `weight_scale` instead, so loading fails with
    "'Embedding' object has no attribute 'weight'". Skip such modules while loading (they are filled from the
    checkpoint), and restore the method afterwards."""
    from torch import nn
    from transformers import PreTrainedModel

    orig = PreTrainedModel._init_weights

    def guarded(self, module):
        if isinstance(module, nn.Embedding) and getattr(module, "weight", None) is None:
            return None
        return orig(self, module)

    PreTrainedModel._init_weights = guarded
    try:
        yield
    finally:
        PreTrainedModel._init_weights = orig


def load_causal_lm(path: str | Path, *, dtype: str = "bfloat16", decompress: bool = True, **kwargs):
    """The model class the config names (AutoModelForCausalLM when transformers lacks it), compressed-tensors
    artifacts decompressed to dense weights unless `decompress=False`."""
    import torch
    import transformers

    config = json.loads((Path(path) / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls or transformers.AutoModelForCausalLM
    qcfg = config.get("quantization_config") or {}
    if decompress and qcfg.get("quant_method") == "compressed-tensors":
        from transformers.utils.quantization_config import CompressedTensorsConfig

        kwargs.setdefault("quantization_config", CompressedTensorsConfig(dequantize=True))
    with _compressed_embeddings_loadable():
        return cls.from_pretrained(path, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, **kwargs)
