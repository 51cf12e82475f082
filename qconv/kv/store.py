"""Packed KV stores: what a runtime holds in memory for a scheme — the records, plus the few exact fp16 tokens.

`PackedKV` holds one sequence (any leading dims: heads, or layers x heads) and is what benchmarks and tests drive.
`SlotKVStore` adapts it to qconv.engine.cache's KVStore protocol (write / read / truncate per layer and slot),
so `make_kv_store("kvarn_k4v2_g128", ...)` in the engine gets packed records through `scheme.new_store(...)`.
A store holds any qconv.kv.base.KVScheme (it only calls its codec), so it does not import base: base builds stores."""

from __future__ import annotations

import torch

from qconv.errors import QconvError

# Tokens that are not (yet) quantized are kept in this dtype by the store and the simulation.
EXACT_DTYPE = torch.float16


class PackedKV:
    """One sequence's cache: sink tile (fp16), quantized records, tile in progress (fp16).

    keep_last_tile keeps an fp16 copy of the newest quantized tile, so a speculative rollback that lands inside it
    restores exact values; a rollback further back decodes the tile instead (counted in `lossy_rollbacks`).

    decoded_tiles > 0 keeps the first that many closed tiles decoded (in the dtype last read) so that a read decodes
    only the tiles closed since the previous one; tiles past the cap are decoded on every read as before. That
    buffer is a speed cache outside the memory bound: `decoded_nbytes` reports it, `nbytes` does not."""

    def __init__(self, scheme, head_dim: int, *, keep_last_tile: bool = False, decoded_tiles: int = 0, device=None):
        self.scheme, self.head_dim, self.keep_last_tile, self.device = scheme, head_dim, keep_last_tile, device
        self.decoded_tiles = decoded_tiles
        self.dec: tuple[torch.Tensor, torch.Tensor] | None = None  # [..., capacity tokens, D] each
        self.n_dec = 0  # closed tiles whose decoded values are in `dec`
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
        self.records[..., self.n_tiles : self.n_tiles + n, :] = rec
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
            tk, tv = k[..., : n * g, :].unflatten(-2, (n, g)), v[..., : n * g, :].unflatten(-2, (n, g))
            self._put(self.scheme.encode(tk, tv))
            if self.keep_last_tile:
                self.last = (tk[..., -1, :, :].clone(), tv[..., -1, :, :].clone())
        self.cur = (k[..., n * g :, :], v[..., n * g :, :])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """All held tokens as (k, v) [..., length, D]."""
        if not self.length:
            raise QconvError("the KV store holds no tokens yet")
        lead = (self.sink or self.cur)[0].shape[:-2]
        k = torch.empty(*lead, self.length, self.head_dim, dtype=dtype, device=(self.sink or self.cur)[0].device)
        v = torch.empty_like(k)
        self.read_into(k, v)
        return k, v

    def read_into(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the first min(length, k.shape[-2]) held tokens into k, v [..., n, D] (their dtype), piece by piece:
        sink, decoded tiles (reused from the decoded-tile cache where it holds them), tile in progress."""
        n, g, pos = min(self.length, k.shape[-2]), self.scheme.tile, 0

        def put(pk: torch.Tensor, pv: torch.Tensor) -> None:
            nonlocal pos
            t = min(pk.shape[-2], n - pos)
            k[..., pos : pos + t, :], v[..., pos : pos + t, :] = pk[..., :t, :], pv[..., :t, :]
            pos += t

        if self.sink is not None:
            put(*self.sink)
        m = self._decode_cached(k.dtype)
        if m:
            put(self.dec[0][..., : m * g, :], self.dec[1][..., : m * g, :])
        last = min(self.n_tiles, m + -(-max(0, n - pos) // g))  # only the tiles that reach into the first n
        if last > m:
            kd, vd = self.scheme.decode(self.records[..., m:last, :], self.head_dim, k.dtype)
            put(kd.flatten(-3, -2), vd.flatten(-3, -2))
        if self.cur is not None and pos < n:
            put(*self.cur)

    def _decode_cached(self, dtype: torch.dtype) -> int:
        """Bring the decoded buffer up to min(n_tiles, decoded_tiles) tiles in `dtype`; returns that tile count."""
        m, g = min(self.n_tiles, self.decoded_tiles), self.scheme.tile
        if not m:
            return 0
        if self.dec is None or self.dec[0].dtype != dtype:
            self.dec, self.n_dec = None, 0
        if self.dec is None or self.dec[0].shape[-2] < m * g:
            cap = min(self.decoded_tiles, max(m, 2 * self.n_dec, 4)) * g
            lead = self.records.shape[:-2]
            new = [torch.empty(*lead, cap, self.head_dim, dtype=dtype, device=self.records.device) for _ in (0, 1)]
            if self.n_dec:
                for x, old in zip(new, self.dec):
                    x[..., : self.n_dec * g, :] = old[..., : self.n_dec * g, :]
            self.dec = (new[0], new[1])
        if self.n_dec < m:
            kd, vd = self.scheme.decode(self.records[..., self.n_dec : m, :], self.head_dim, dtype)
            self.dec[0][..., self.n_dec * g : m * g, :] = kd.flatten(-3, -2)
            self.dec[1][..., self.n_dec * g : m * g, :] = vd.flatten(-3, -2)
            self.n_dec = m
        return m

    @property
    def decoded_nbytes(self) -> int:
        """Bytes of the decoded-tile speed cache (0 unless decoded_tiles > 0)."""
        return sum(x.numel() * x.element_size() for x in self.dec) if self.dec is not None else 0

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (speculative rollback)."""
        if n >= self.length:
            return
        g, s0 = self.scheme.tile, self._sink_len
        q_end = s0 + self.n_tiles * g
        if n >= q_end:
            self.cur = (self.cur[0][..., : n - q_end, :], self.cur[1][..., : n - q_end, :])
        elif n >= s0:
            i, off = divmod(n - s0, g)
            if self.last is not None and i == self.n_tiles - 1:
                tk, tv = self.last
            else:
                self.lossy_rollbacks += 1
                tk, tv = (
                    x[..., 0, :, :].to(EXACT_DTYPE)
                    for x in self.scheme.decode(self.records[..., i : i + 1, :], self.head_dim)
                )
            self.n_tiles, self.last = i, None
            self.cur = (tk[..., :off, :], tv[..., :off, :])
        else:
            self.cur = (self.sink[0][..., :n, :], self.sink[1][..., :n, :])
            self.sink, self.n_tiles, self.last = None, 0, None
        self.length = n
        self.n_dec = min(self.n_dec, self.n_tiles)

    @property
    def nbytes(self) -> int:
        """Bytes the held tokens occupy: records in use plus exact fp16 tokens (the rollback copy not counted)."""
        rec = self.records[..., : self.n_tiles, :].numel() if self.records is not None else 0
        exact = sum(x.numel() * x.element_size() for pair in (self.sink, self.cur) if pair is not None for x in pair)
        return rec + exact


class SlotKVStore:
    """qconv.engine.cache.KVStore over PackedKV: one packed sequence per (layer, slot); heads are batched."""

    def __init__(
        self,
        scheme,
        layers: int,
        max_batch: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device=None,
        decoded_cache_bytes: int = 0,
    ):
        """decoded_cache_bytes: total budget for decoded closed tiles (see PackedKV), split evenly over the
        (layer, slot) sequences; 0 (default) decodes every closed tile on every read."""
        self.scheme, self.heads, self.head_dim, self.dtype, self.device = scheme, heads, head_dim, dtype, device
        tile_bytes = 2 * heads * scheme.tile * head_dim * dtype.itemsize
        self.decoded_tiles = decoded_cache_bytes // (layers * max_batch * tile_bytes) if layers * max_batch else 0
        self.seqs = [[self._new() for _ in range(max_batch)] for _ in range(layers)]

    def _new(self) -> PackedKV:
        return PackedKV(
            self.scheme, self.head_dim, keep_last_tile=True, decoded_tiles=self.decoded_tiles, device=self.device
        )

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
        k = torch.empty(len(slots), self.heads, length, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        for b, s in enumerate(slots):
            held = min(length, self.seqs[layer][s].length)
            self.seqs[layer][s].read_into(k[b], v[b])
            k[b, :, held:], v[b, :, held:] = 0, 0
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

    @property
    def decoded_nbytes(self) -> int:
        return sum(seq.decoded_nbytes for layer in self.seqs for seq in layer)
