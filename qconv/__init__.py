"""qconv: turn a full-precision LLM checkpoint into a small, fast, measured artifact and serve it."""

from qconv.version import __version__

__all__ = ["__version__", "load"]


def load(path, dtype: str = "bfloat16", **kwargs):
    """A qconv artifact (or any Hugging Face model folder) as a transformers model, its compressed weights
    dequantized. transformers' own `AutoModelForCausalLM.from_pretrained` cannot load a pack-quantized embed_tokens
    (README, "An artifact is..."); this is the documented way in. `kwargs` go to `from_pretrained`."""
    from qconv.convert.hfmodel import load_causal_lm

    return load_causal_lm(path, dtype=dtype, **kwargs)
