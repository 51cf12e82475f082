"""Model sources, quantization through llmcompressor, and the artifact writer."""
