"""Packed KV stores: what a runtime holds in memory for a scheme — the records, plus the few exact fp16 tokens.

`PackedKV` holds one sequence (any leading dims: heads, or layers x heads) and is what benchmarks and tests drive.
`SlotKVStore` adapts it to qconv.runtime.cache's KVStore protocol (write / read / truncate per layer and slot),
so `make_kv_store("kvarn_k4v2_g128", ...)` in the runtime gets packed records through `scheme.new_store(...)`."""

from __future__ import annotations

import torch

from qconv.errors import QconvError
from qconv.kv.base import EXACT_DTYPE, KVScheme


class PackedKV:
    """One sequence's cache: sink tile (fp16), quantized records, tile in progress (fp16).

    keep_last_tile keeps an fp16 copy of the newest quantized tile, so a speculative rollback that lands inside it
    restores exact values; a rollback further back decodes the tile instead (counted in `lossy_rollbacks`)."""

    def __init__(self, scheme: KVScheme, head_dim: int, *, keep_last_tile: bool = False, device=None):
        self.scheme, self.head_dim, self.keep_last_tile, self.device = scheme, head_dim, keep_last_tile, device
        self.length = 0
        self.n_tiles = 0
        self.records: torch.Tensor | None = None  # [..., capacity, record_bytes]
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cur: tuple[torch.Tensor, torch.Tensor] | None = None  # [..., <tile, D] each
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # fp16 copy of tile n_tiles-1
        self.lossy_rollbacks = 0
        self._calibrated = False

    @property
    def _sink_len(self) -> int:
        return self.scheme.tile if self.sink is not None else 0

    def _put(self, rec: torch.Tensor) -> None:
        n = rec.shape[-2]
        if self.records is None:
            self.records = rec.new_empty(*rec.shape[:-2], max(n, 16), rec.shape[-1])
        elif self.n_tiles + n > self.records.shape[-2]:
            grow = max(self.n_tiles + n, 2 * self.records.shape[-2]) - self.records.shape[-2]
            self.records = torch.cat([self.records, self.records.new_empty(*rec.shape[:-2], grow, rec.shape[-1])], -2)
        self.records[..., self.n_tiles:self.n_tiles + n, :] = rec
        self.n_tiles += n

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens k, v [..., T, D]; every tile that fills is quantized at once (one batched encode)."""
        if not self._calibrated:  # per-tensor constants (fp8 scales) come from the first write, the prompt
            self.scheme, self._calibrated = self.scheme.calibrated(k, v), True
        g = self.scheme.tile
        k, v = k.to(EXACT_DTYPE), v.to(EXACT_DTYPE)
        self.length += k.shape[-2]
        if self.cur is not None:
            k, v = torch.cat([self.cur[0], k], -2), torch.cat([self.cur[1], v], -2)
        if self.scheme.sink and self.sink is None and k.shape[-2] >= g:
            self.sink, k, v = (k[..., :g, :], v[..., :g, :]), k[..., g:, :], v[..., g:, :]
        n = k.shape[-2] // g
        if n:
            tk, tv = k[..., :n * g, :].unflatten(-2, (n, g)), v[..., :n * g, :].unflatten(-2, (n, g))
            self._put(self.scheme.encode(tk, tv))
            if self.keep_last_tile:
                self.last = (tk[..., -1, :, :].clone(), tv[..., -1, :, :].clone())
        self.cur = (k[..., n * g:, :], v[..., n * g:, :])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """All held tokens as (k, v) [..., length, D]."""
        ks, vs = [], []
        if self.sink is not None:
            ks.append(self.sink[0].to(dtype)), vs.append(self.sink[1].to(dtype))
        if self.n_tiles:
            kd, vd = self.scheme.decode(self.records[..., :self.n_tiles, :], self.head_dim, dtype)
            ks.append(kd.flatten(-3, -2)), vs.append(vd.flatten(-3, -2))
        if self.cur is not None:
            ks.append(self.cur[0].to(dtype)), vs.append(self.cur[1].to(dtype))
        if not ks:
            raise QconvError("the KV store holds no tokens yet")
        return torch.cat(ks, -2), torch.cat(vs, -2)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (speculative rollback)."""
        if n >= self.length:
            return
        g, s0 = self.scheme.tile, self._sink_len
        q_end = s0 + self.n_tiles * g
        if n >= q_end:
            self.cur = (self.cur[0][..., :n - q_end, :], self.cur[1][..., :n - q_end, :])
        elif n >= s0:
            i, off = divmod(n - s0, g)
            if self.last is not None and i == self.n_tiles - 1:
                tk, tv = self.last
            else:
                self.lossy_rollbacks += 1
                tk, tv = (x[..., 0, :, :].to(EXACT_DTYPE) for x in
                          self.scheme.decode(self.records[..., i:i + 1, :], self.head_dim))
            self.n_tiles, self.last = i, None
            self.cur = (tk[..., :off, :], tv[..., :off, :])
        else:
            self.cur = (self.sink[0][..., :n, :], self.sink[1][..., :n, :])
            self.sink, self.n_tiles, self.last = None, 0, None
        self.length = n

    @property
    def nbytes(self) -> int:
        """Bytes the held tokens occupy: records in use plus exact fp16 tokens (the rollback copy not counted)."""
        rec = self.records[..., :self.n_tiles, :].numel() if self.records is not None else 0
        exact = sum(x.numel() * x.element_size() for pair in (self.sink, self.cur) if pair is not None for x in pair)
        return rec + exact


class SlotKVStore:
    """qconv.runtime.cache.KVStore over PackedKV: one packed sequence per (layer, slot); heads are batched."""

    def __init__(self, scheme: KVScheme, layers: int, max_batch: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device=None):
        self.scheme, self.heads, self.head_dim, self.dtype, self.device = scheme, heads, head_dim, dtype, device
        self.seqs = [[self._new() for _ in range(max_batch)] for _ in range(layers)]

    def _new(self) -> PackedKV:
        return PackedKV(self.scheme, self.head_dim, keep_last_tile=True, device=self.device)

    def write(self, layer: int, slots: list[int], starts: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, T, H, D], appended at starts[b] of slots[b] (a start below the held length truncates first)."""
        for b, (s, p) in enumerate(zip(slots, starts)):
            seq = self.seqs[layer][s]
            if p > seq.length:
                raise QconvError(f"KV write at token {p} of slot {s}, but layer {layer} holds {seq.length}")
            if p == 0:
                seq = self.seqs[layer][s] = self._new()
            seq.truncate(p)
            seq.append(k[b].transpose(0, 1), v[b].transpose(0, 1))

    def read(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H, length, D] in the compute dtype; positions a slot does not hold are zeros (masked by the caller)."""
        k = torch.zeros(len(slots), self.heads, length, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        for b, s in enumerate(slots):
            seq = self.seqs[layer][s]
            if seq.length:
                kd, vd = seq.dequantize(self.dtype)
                n = min(length, seq.length)
                k[b, :, :n], v[b, :, :n] = kd[..., :n, :], vd[..., :n, :]
        return k, v

    def truncate(self, slots: list[int], n_keep: list[int]) -> None:
        for layer in self.seqs:
            for s, n in zip(slots, n_keep):
                if n == 0:
                    layer[s] = self._new()
                else:
                    layer[s].truncate(n)

    @property
    def nbytes(self) -> int:
        return sum(seq.nbytes for layer in self.seqs for seq in layer)
