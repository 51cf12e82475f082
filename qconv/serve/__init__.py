"""qconv serve: OpenAI-compatible serving on qconv's engine (continuous batching) or through vLLM."""
