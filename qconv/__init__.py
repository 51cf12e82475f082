"""qconv: turn a full-precision LLM checkpoint into a small, fast, measured artifact and serve it."""

__version__ = "0.1.0"
