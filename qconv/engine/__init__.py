"""The bundled engine: our own model code for the llama family and the qwen3_5 hybrid."""

from qconv.engine.loader import load_model, load_tokenizer

__all__ = ["load_model", "load_tokenizer"]
