"""A tied lm_head on a pack-quantized embed_tokens: the logits come from the embedding's own packed weights.

vLLM 0.32 ties a head with `ParallelLMHead.tie_weights`, which hands off to the head's quant method; every method
shares `embed_tokens.weight`, which a pack-quantized embedding does not have (it holds `weight_packed` and
`weight_scale`), and `CompressedTensorsEmbeddingWNA16Int.apply` raises (lookups only). So the tie returns the
quantized embedding module itself as the lm_head (one table, as in the checkpoint), and the method gets an `apply`
that `LogitsProcessor` calls with the hidden states: it dequantizes the table in row blocks, through the method's
own lookup (vLLM's Triton gather on GPUs, the plugin's torch one on CPU), and multiplies. Marlin's W8A16 path is
not reused: it repacks its weights in place, so it would need a second, repacked copy of the table in memory. On
the CPU the dequantized table is kept after the first call (host memory; dequantizing it every step cost more than
the matmul); on a GPU, where memory is the card's, it is dequantized per call in row blocks.
"""

from __future__ import annotations

import functools

import torch

from qconv_vllm import patches

ROWS = 8192  # vocabulary rows dequantized at a time: bounds the transient dense block to ROWS x hidden


def _method():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding import (
        CompressedTensorsEmbeddingWNA16Int,
    )

    return CompressedTensorsEmbeddingWNA16Int


def _tie_to_packed_embedding() -> None:
    method, orig = _method(), patches.current("tie_weights")

    @functools.wraps(orig)
    def tie_weights(self, embed_tokens):
        if isinstance(getattr(embed_tokens, "quant_method", None), method):
            return embed_tokens  # vocab-sharded like a head; LogitsProcessor calls quant_method.apply on it
        return orig(self, embed_tokens)

    patches.replace(tie_weights=tie_weights)


def _row_blocks(method, layer: torch.nn.Module):
    """(first row, dequantized rows) of the packed table, ROWS at a time, through the method's own lookup."""
    vocab, device = layer.weight_packed.shape[0], layer.weight_packed.device
    for start in range(0, vocab, ROWS):
        yield start, method.embedding(layer, torch.arange(start, min(start + ROWS, vocab), device=device))


def _logits_from_packed_rows() -> None:
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden @ dequant(W).T over this rank's (padded) vocabulary rows; LogitsProcessor drops the padding."""
        vocab = layer.weight_packed.shape[0]
        flat = x.reshape(-1, x.shape[-1])
        dense = getattr(layer, "qconv_dense_head", None)
        if x.device.type == "cpu" and (dense is None or dense.dtype != x.dtype):
            dense = layer.qconv_dense_head = torch.cat([rows.to(x.dtype) for _, rows in _row_blocks(self, layer)])
        if dense is not None:
            out = flat @ dense.t()
        else:
            out = torch.empty(flat.shape[0], vocab, dtype=x.dtype, device=x.device)
            for start, rows in _row_blocks(self, layer):
                out[:, start : start + len(rows)] = flat @ rows.to(x.dtype).t()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], vocab)

    patches.replace(packed_head_apply=apply)


def apply() -> list[str]:
    _tie_to_packed_embedding()
    _logits_from_packed_rows()
    return ["lm_head tied to a quantized embed_tokens"]
