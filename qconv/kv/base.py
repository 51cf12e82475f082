"""The KV-scheme interface shared by simulated attention (`qconv eval --kv`), the engine's packed store and the planner.

A scheme is a codec for fixed-size records: `encode` turns `tile` consecutive tokens of K and V (per head) into one
uint8 record, `decode` turns records back into K and V. Tile semantics live here, once, for every scheme: with
`sink` the first tile of a sequence stays exact, and the tile being filled stays exact until it is full."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qconv.kv.store import EXACT_DTYPE, SlotKVStore

# Bound on the float32 elements one encode/decode step touches at once (a 128K-token cache does not fit twice in RAM).
CHUNK_ELEMS = 1 << 22


@dataclass(frozen=True)
class KVScheme:
    name: str
    tile: int = 1  # tokens per record
    sink: bool = False  # first tile of every sequence stays exact

    # --- codec: subclasses implement these three ---------------------------------------------------------------
    def record_bytes(self, head_dim: int) -> int:
        """Bytes of one record (one tile of one head, K and V together)."""
        raise NotImplementedError

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """float32 [N, tile, D] x2 -> uint8 records [N, record_bytes]."""
        raise NotImplementedError

    def _decode(self, rec: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 records [N, record_bytes] -> float32 (k, v), each [N, tile, D]."""
        raise NotImplementedError

    def calibrated(self, k: torch.Tensor, v: torch.Tensor) -> KVScheme:
        """The scheme with any per-tensor constants fixed from this data (fp8 scales); most schemes have none."""
        return self

    # --- sizes ---------------------------------------------------------------------------------------------------
    def bytes_per_token_per_head(self, head_dim: int) -> float:
        """Steady-state bytes per token per KV head, K and V together (exact sink/partial tiles not counted)."""
        return self.record_bytes(head_dim) / self.tile

    def bits_per_element(self, head_dim: int) -> float:
        return 8 * self.bytes_per_token_per_head(head_dim) / (2 * head_dim)

    def serving_work_bytes(
        self, layers: int, q_heads: int, kv_heads: int, head_dim: int, max_num_seqs: int, batched_tokens: int
    ) -> int:
        """Device memory a GPU runtime needs beside the KV pool to serve this scheme (none for plain caches)."""
        return 0

    def max_exact_tokens(self) -> int:
        """Most tokens a sequence holds exactly (fp16) at once: the sink plus a tile being filled."""
        return (self.tile if self.sink else 0) + self.tile - 1

    def stored_bytes_per_head(self, tokens: int, head_dim: int) -> int:
        """Exact bytes one KV head of one sequence of `tokens` tokens occupies (records + exact fp16 tokens)."""
        n_sink, n_tiles, n_tail = self.split(tokens)
        exact = (n_sink + n_tail) * 2 * head_dim * EXACT_DTYPE.itemsize
        return n_tiles * self.record_bytes(head_dim) + exact

    def split(self, tokens: int) -> tuple[int, int, int]:
        """(exact sink tokens, quantized tiles, exact tail tokens) for a sequence of `tokens` tokens."""
        n_sink = min(tokens, self.tile) if self.sink else 0
        n_tiles = (tokens - n_sink) // self.tile
        return n_sink, n_tiles, tokens - n_sink - n_tiles * self.tile

    # --- batched codec over any leading dims ---------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[..., n_tiles, tile, D] x2 -> uint8 [..., n_tiles, record_bytes], in memory-bounded chunks of tiles."""
        lead, d = k.shape[:-2], k.shape[-1]
        kf, vf = k.reshape(-1, self.tile, d), v.reshape(-1, self.tile, d)
        step = max(1, CHUNK_ELEMS // (self.tile * d))
        out = torch.empty(kf.shape[0], self.record_bytes(d), dtype=torch.uint8, device=k.device)
        for i in range(0, kf.shape[0], step):
            out[i : i + step] = self._encode(kf[i : i + step].float(), vf[i : i + step].float())
        return out.reshape(*lead, -1)

    def decode(
        self, rec: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [..., n_tiles, record_bytes] -> (k, v), each [..., n_tiles, tile, D] in `dtype`."""
        lead = rec.shape[:-1]
        flat = rec.reshape(-1, rec.shape[-1])
        k = torch.empty(flat.shape[0], self.tile, head_dim, dtype=dtype, device=rec.device)
        v = torch.empty_like(k)
        step = max(1, CHUNK_ELEMS // (self.tile * head_dim))
        for i in range(0, flat.shape[0], step):
            kd, vd = self._decode(flat[i : i + step], head_dim)
            k[i : i + step], v[i : i + step] = kd, vd
        return k.reshape(*lead, self.tile, head_dim), v.reshape(*lead, self.tile, head_dim)

    def new_store(
        self,
        *,
        layers: int,
        max_batch: int,
        max_len: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device=None,
        decoded_cache_bytes: int = 0,
    ):
        """The engine's KVStore (qconv.engine.cache) holding this scheme's packed records per (layer, slot);
        decoded_cache_bytes > 0 lets reads reuse decoded closed tiles (a speed cache, outside the memory bound)."""
        return SlotKVStore(self, layers, max_batch, heads, head_dim, dtype, device, decoded_cache_bytes)

    # --- simulation ----------------------------------------------------------------------------------------------
    def decode_time(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What each position's own decode step reads from the engine's store (qconv.kv.store): token j quantized
        once its tile has closed (filled) by the time position i is written, exact otherwise (the sink, the tile
        being filled). Returns keys and values [..., 2T, D] (`fake_quant` of the sequence, then the exact one)
        and a bool mask [T, 2T] saying which of the two copies query i attends to, causal included."""
        t = k.shape[-2]
        kq, vq = self.fake_quant(k, v)
        j = torch.arange(t, device=k.device)
        closed = ((j // self.tile + 1) * self.tile - 1)[None, :] <= j[:, None]
        if self.sink:
            closed &= j[None, :] >= self.tile
        causal = j[None, :] <= j[:, None]
        exact = lambda x: x.to(EXACT_DTYPE).to(x.dtype)  # noqa: E731
        mask = torch.cat([causal & closed, causal & ~closed], -1)
        return torch.cat([kq, exact(k)], -2), torch.cat([vq, exact(v)], -2), mask

    def fake_quant(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention sees after the whole sequence so far was written to this cache.

        k, v: [batch, heads, tokens, head_dim]. Full tiles go through encode -> decode (packing included, so the
        simulation is bit-for-bit the store's dequantization); the sink and the partial last tile are fp16."""
        t, d = k.shape[-2], k.shape[-1]
        n_sink, n_tiles, _ = self.split(t)
        q0, q1 = n_sink, n_sink + n_tiles * self.tile
        s = self.calibrated(k, v)

        def piece(x, lo, hi):
            return x[..., lo:hi, :].to(EXACT_DTYPE).to(x.dtype)

        out_k, out_v = [piece(k, 0, q0)], [piece(v, 0, q0)]
        if n_tiles:  # encoded from the fp16 rows, as the store holds them until their tile closes
            tk = k[..., q0:q1, :].to(EXACT_DTYPE).unflatten(-2, (n_tiles, self.tile))
            tv = v[..., q0:q1, :].to(EXACT_DTYPE).unflatten(-2, (n_tiles, self.tile))
            kd, vd = s.decode(s.encode(tk, tv), d, k.dtype)
            out_k.append(kd.flatten(-3, -2))
            out_v.append(vd.flatten(-3, -2))
        out_k.append(piece(k, q1, t))
        out_v.append(piece(v, q1, t))
        return torch.cat(out_k, -2), torch.cat(out_v, -2)
