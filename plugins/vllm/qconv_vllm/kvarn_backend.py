"""KVarN as a vLLM attention backend: the `kvarn_*` cache dtypes on full-attention layers.

Cache: one vLLM block is one tile of G tokens (the backend's only kernel block size; larger manager blocks, as
hybrid models get, are split into tiles by vLLM). Per (block, KV head) the page holds one KVarN record, K and V
together, so a slot costs record_bytes / G per token and head (`customize_spec`), never padded to a power of two.
The first tile of a sequence (sink), the tile being filled and a copy of the last closed tile stay fp16 in a small
per-layer staging buffer indexed by a sequence slot (`SlotTable`), outside the paged pool: 3 tiles a slot.

Work memory vLLM's profiler sees (`reserve`): the staging buffer is allocated when vLLM builds the layer (model
memory), and the profiling forward, which has no metadata, takes the attention's worst-case transient bytes for
the batch it profiles (`kvarn_attention.work_bytes`), so the KV pool vLLM sizes afterwards leaves room for both.

Attention is the decode form: a query at position i reads token j from its quantized tile once that tile closed at
or before i, from the fp16 copy otherwise, so a prompt's logits are what token-by-token decoding would give.
This module is the torch path (vLLM's CPU backend has no Triton); on CUDA, tiles are encoded by
`qconv_vllm.kvarn_triton` and every batch (decodes, verifies, prefill chunks, mixed) is one split-K Triton launch
(`qconv_vllm.kvarn_attention`) whose extra memory grows with the batch's tokens, not the context. Gated-DeltaNet
layers keep their own state: only attention layers come here."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import ClassVar

import torch

from qconv_vllm import KVARN_PRESETS as PRESETS
from qconv_vllm.kvarn_codec import Codec
from qconv_vllm.kvarn_metadata import KVarNMetadata, SlotTable, host_lists, slot_capacity, step_metadata

log = logging.getLogger(__name__)
SINK, CUR, LAST = 0, 1, 2  # staging tiles per slot
QUERY_CHUNK = 512  # queries scored at once (bounds the [heads, queries, keys] score matrix of a long prompt)


def _builder_cls():
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder

    class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
        # The attention kernel's grid and arguments depend on shapes only, but a step's writes are host-driven
        # (staging slots from the SlotTable, per-request writes of the new tokens), so a captured graph would
        # replay stale slots and positions: no CUDA graphs for KVarN layers (vLLM runs them eagerly between
        # graph pieces of the other layers).
        _cudagraph_support: ClassVar = AttentionCGSupport.NEVER

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            if vllm_config.cache_config.enable_prefix_caching:
                raise ValueError(
                    "KVarN KV cache: prefix caching would share a quantized first tile that KVarN "
                    "keeps in fp16; start vLLM with --no-enable-prefix-caching"
                )
            self.table = SlotTable(slot_capacity(vllm_config.scheduler_config.max_num_seqs))
            self.tile = Codec.from_dtype(vllm_config.cache_config.cache_dtype, kv_cache_spec.head_size).tile
            # the CPU upper bound of seq_lens is exact unless drafts are scheduled before the last step's
            # acceptance is known (async scheduling with speculative decoding)
            sched = vllm_config.scheduler_config
            self.exact_cpu_lens = not (vllm_config.speculative_config and sched.async_scheduling)

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> KVarNMetadata:
            cam = common_attn_metadata
            qs, lens, keys = host_lists(cam, self.exact_cpu_lens)
            return step_metadata(self.table, qs, lens, keys, cam.block_table_tensor[: cam.num_reqs], self.tile)

    return KVarNMetadataBuilder


class KVarNAttentionImpl:
    """Per attention layer: writes each step's K/V (tiles that fill are quantized at once) and attends over sink +
    closed records + fp16 tokens. Built by vLLM through the backend; subclassed from vLLM's AttentionImpl at
    import time of `backend_cls()` (this module imports without vLLM for the codec tests)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap=None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name=None,
        **kwargs,
    ):
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise ValueError(
                "KVarN attention supports plain causal attention only (no ALiBi, sliding window or logit soft-capping)"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.codec = Codec.from_dtype(kv_cache_dtype, head_size)
        self.stage: torch.Tensor | None = None  # [slots, 3 tiles, 2 (k, v), kv heads, G, D] fp16
        self.kernels: bool | None = None  # Triton attention: None = on CUDA tensors (tests force it on CPU)
        self.max_seqs = 0  # set by `reserve`

    def reserve(self, max_num_seqs: int, device) -> None:
        """Allocate the staging buffer now, for every slot the scheduler may use (`slot_capacity`), so that it
        is model memory to vLLM's profiler, and size the profiling forward's work memory by max_num_seqs."""
        self.max_seqs = max_num_seqs
        self._staging(slot_capacity(max_num_seqs), device)

    def _staging(self, capacity: int, device) -> torch.Tensor:
        g, d = self.codec.tile, self.head_size
        if self.stage is None or self.stage.shape[0] < capacity or self.stage.device.type != torch.device(device).type:
            self.stage = torch.zeros(capacity, 3, 2, self.num_kv_heads, g, d, dtype=torch.float16, device=device)
        return self.stage

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None, output_block_scale=None
    ):
        if output is None:
            output = torch.zeros(
                query.shape[0], self.num_heads * self.head_size, dtype=query.dtype, device=query.device
            )
        if attn_metadata is None:  # profiling run: no cache yet; the peak it measures must include our work memory
            if self.max_seqs:  # (on the CPU an untouched empty tensor costs nothing)
                from qconv_vllm.kvarn_attention import work_bytes

                h, hk = self.num_heads, self.num_kv_heads
                n = work_bytes(query.shape[0], self.max_seqs, h, hk, self.head_size, self.codec.tile)
                torch.empty(n, dtype=torch.uint8, device=query.device)
            return output.fill_(0)
        m: KVarNMetadata = attn_metadata
        stage = self._staging(m.capacity, query.device)
        pool = kv_cache.flatten(2)  # [tiles, kv heads, record bytes]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        q_all = query[: m.num_actual_tokens].view(-1, h, d)
        k_all = key[: m.num_actual_tokens].view(-1, hk, d)
        v_all = value[: m.num_actual_tokens].view(-1, hk, d)
        out = output[: m.num_actual_tokens].view(-1, h, d)
        kernels = query.is_cuda if self.kernels is None else self.kernels
        exacts, closing = [], []
        for i, slot in enumerate(m.slots):  # stage every request's new tokens; collect the tiles they close
            q0, q1 = m.query_start[i], m.query_start[i + 1]
            start = m.seq_lens[i] - (q1 - q0)
            if m.fresh[i]:
                stage[slot].zero_()
            exact = None
            if q1 > q0:
                exact = self._write(
                    stage[slot], m.block_table[i], start, m.written_before[i], k_all[q0:q1], v_all[q0:q1]
                )
                closing += [exact[1]] if exact[1] is not None else []
                exact = exact[0]
            exacts.append(exact)
        if closing:  # every tile closed this step, all requests together: one encode, one scatter into the pool
            tiles = torch.cat([c[0] for c in closing], 1)  # [2, n, kv heads, G, D]
            rec = self._encode(tiles[0].flatten(0, 1), tiles[1].flatten(0, 1))
            pool[torch.cat([c[1] for c in closing]).long()] = rec.view(tiles.shape[1], self.num_kv_heads, -1)
        if kernels and m.slots:
            runs = [self._exact_run(stage[s], n, e) for s, n, e in zip(m.slots, m.seq_lens, exacts)]
            out[: m.query_start[-1]] = self._attend_kernels(pool, m, q_all[: m.query_start[-1]], runs)
        elif not kernels:
            for i, slot in enumerate(m.slots):
                q0, q1 = m.query_start[i], m.query_start[i + 1]
                if q1 > q0:
                    length, blocks = m.seq_lens[i], m.block_table[i]
                    o = self._attend(stage[slot], pool, blocks, length - (q1 - q0), length, q_all[q0:q1], exacts[i])
                    out[q0:q1] = o.to(out.dtype)
        return output

    def _exact_run(self, st, length, exact) -> torch.Tensor:
        """The fp16 tokens a request's queries may read exactly, [2, kv heads, n, D]: the sink, then `exact`
        (`_write`'s return), at the positions `exact_positions` lists."""
        sink = st[SINK, :, :, : min(length, self.codec.tile)]
        return sink if exact is None else torch.cat([sink, exact], 2)

    def _attend_kernels(self, pool, m: KVarNMetadata, q, runs):
        """Every query of the batch in one Triton launch (qconv_vllm.kvarn_attention.attention): decodes,
        verifies and prefill chunks alike; extra memory proportional to the batch's tokens (`work_bytes`)."""
        from qconv_vllm.kvarn_attention import attention

        ex = torch.cat(runs, 2)  # [2, kv heads, E, D]
        n, b = m.n_exact, len(m.seq_lens)
        if ex.shape[2] != n:
            raise RuntimeError(f"KVarN: {ex.shape[2]} exact tokens staged, the step's metadata lists {n}")
        return attention(
            q,
            pool,
            m.block_table,
            m.ints[n + b + 1 : n + 2 * b + 1],
            m.ints[n + 2 * b + 1 :],
            ex[0],
            ex[1],
            m.ints[:n],
            m.ints[n : n + b + 1],
            self.codec.k_bits,
            self.codec.v_bits,
            self.codec.tile,
            self.scale,
        )

    def _encode(self, k, v):
        if k.is_cuda:
            from qconv_vllm.kvarn_triton import encode_tiles

            return encode_tiles(k, v, self.codec.k_bits, self.codec.v_bits)
        return self.codec.encode(k, v)

    def _write(self, st, blocks, start, written, k, v):
        """Stage the new tokens (positions start..); returns (the fp16 K/V [2, kv heads, n, D] of positions
        first_open_tile*G .. end, or None when all are in the sink; the tiles they close, [2, n, kv heads, G, D],
        with their block ids, or None) -- the caller encodes every request's closed tiles at once."""
        g = self.codec.tile
        kv = torch.stack([k, v]).transpose(1, 2).to(torch.float16)  # [2, kv heads, T, D]
        end = start + kv.shape[2]
        n_sink = max(0, min(end, g) - start)
        if n_sink:
            st[SINK, :, :, start : start + n_sink] = kv[:, :, :n_sink]
        p0 = start + n_sink
        if p0 == end:
            return None, None
        t0, o0 = divmod(p0, g)
        # The exact head of tile t0: the tile in progress, or, after a speculative rollback into the tile closed
        # last step, its fp16 copy.
        head = st[LAST if written >= (t0 + 1) * g else CUR, :, :, :o0]
        exact = torch.cat([head, kv[:, :, n_sink:]], 2)
        n_full = exact.shape[2] // g
        closed = None
        if n_full:
            tiles = exact[:, :, : n_full * g].unflatten(2, (n_full, g)).permute(0, 2, 1, 3, 4)  # [2, n, hk, G, D]
            closed = (tiles, blocks[t0 : t0 + n_full])
            st[LAST] = tiles[:, -1]
        rest = exact.shape[2] - n_full * g
        st[CUR, :, :, :rest] = exact[:, :, n_full * g :]
        return exact, closed

    def _attend(self, st, pool, blocks, start, length, q, exact):
        """Decode-form attention of queries at positions start..length-1 -> [T, heads, D] float32."""
        g = self.codec.tile
        dev = q.device
        parts_k, parts_v, pos, kind = [st[SINK, 0, :, : min(length, g)]], [st[SINK, 1, :, : min(length, g)]], [], []
        pos.append(torch.arange(min(length, g), device=dev))
        kind.append(torch.zeros(min(length, g), dtype=torch.long, device=dev))  # 0 sink, 1 quantized, 2 exact
        closed = max(0, length // g - 1)  # tiles 1..closed are records
        if closed:
            kq, vq = self.codec.decode(pool[blocks[1 : closed + 1].long()])  # [closed, hk, G, D]
            parts_k.append(kq.transpose(0, 1).flatten(1, 2))
            parts_v.append(vq.transpose(0, 1).flatten(1, 2))
            pos.append(torch.arange(g, (closed + 1) * g, device=dev))
            kind.append(torch.ones(closed * g, dtype=torch.long, device=dev))
        if exact is not None:
            first = length - exact.shape[2]
            parts_k.append(exact[0])
            parts_v.append(exact[1])
            pos.append(torch.arange(first, length, device=dev))
            kind.append(torch.full((exact.shape[2],), 2, dtype=torch.long, device=dev))
        keys = torch.cat([x.float() for x in parts_k], 1)  # [hk, S, D]
        vals = torch.cat([x.float() for x in parts_v], 1)
        kpos, kkind = torch.cat(pos), torch.cat(kind)
        tile_end = (kpos // g + 1) * g - 1  # position at which each key's tile closes
        out = torch.empty(q.shape[0], self.num_heads, self.head_size, dtype=torch.float32, device=dev)
        for c0 in range(0, q.shape[0], QUERY_CHUNK):
            qc = q[c0 : c0 + QUERY_CHUNK].float()
            t = qc.shape[0]
            lo, hi = start + c0, start + c0 + t - 1
            # only the keys some query of the chunk reads: causal, a record once its tile closed by `hi`, an fp16
            # copy while its tile is still open at `lo`
            need = (kpos <= hi) & ((kkind == 0) | ((kkind == 1) & (tile_end <= hi)) | ((kkind == 2) & (tile_end > lo)))
            idx = need.nonzero().squeeze(1)
            kp, kk, te = kpos[idx][None, :], kkind[idx][None, :], tile_end[idx][None, :]
            qpos = torch.arange(lo, hi + 1, device=dev)[:, None]
            closed_by_q = te <= qpos
            seen = (kp <= qpos) & ((kk == 0) | ((kk == 1) & closed_by_q) | ((kk == 2) & ~closed_by_q))
            o = torch.nn.functional.scaled_dot_product_attention(
                qc.transpose(0, 1).unsqueeze(0),  # [1, heads, T, D]
                keys[None, :, idx],
                vals[None, :, idx],
                attn_mask=seen,
                scale=self.scale,
                enable_gqa=True,
            )
            out[c0 : c0 + t] = o[0].transpose(0, 1)
        return out


@functools.cache
def backend_cls(preset: str):
    """The backend class of one preset, built against the running vLLM on first use (only vLLM processes touch it;
    the codec and the attention above import without vLLM). One class per preset: vLLM asks a backend class, not
    the config, for its page size and kernel block size (`customize_spec` may run where no config is current)."""
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl
    from vllm.v1.kv_cache_layout import KVCacheLayout

    tile = Codec.from_dtype(preset, 64).tile
    builder = _builder_cls()

    def init(self, *args, **kwargs):
        from vllm.config import get_current_vllm_config

        KVarNAttentionImpl.__init__(self, *args, **kwargs)
        cfg = get_current_vllm_config()
        self.reserve(cfg.scheduler_config.max_num_seqs, cfg.device_config.device)

    impl = type("KVarNAttentionImpl", (KVarNAttentionImpl, AttentionImpl), {"__init__": init})

    class KVarNAttentionBackend(AttentionBackend):
        accept_output_buffer: bool = True
        forward_includes_kv_cache_update: bool = True
        supported_dtypes: ClassVar = [torch.float16, torch.bfloat16, torch.float32]
        supported_kv_cache_dtypes: ClassVar = [preset]

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return impl

        @staticmethod
        def get_builder_cls():
            return builder

        @classmethod
        def customize_spec(cls, spec):
            if spec.state_content_bytes is not None:
                return spec
            return replace(spec, state_content_bytes=Codec.from_dtype(preset, spec.head_size).bytes_per_token)

        @classmethod
        def get_supported_kernel_block_sizes(cls, kv_cache_spec=None):
            return [tile]  # one block = one tile; vLLM splits larger (hybrid) blocks into tiles

        @classmethod
        def supported_kv_cache_layouts(cls):
            return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)  # a record is one contiguous run of [N, C]

        @classmethod
        def supports_head_size(cls, head_size: int) -> bool:
            return head_size in (64, 128, 256)

    KVarNAttentionBackend.__qualname__ = KVarNAttentionBackend.__name__ = f"KVarNAttentionBackend_{preset}"
    return KVarNAttentionBackend


def __getattr__(name: str):
    """`qconv_vllm.kvarn_backend.<preset>`: the class paths the platform hook hands to vLLM's selector."""
    if name in PRESETS:
        return backend_cls(name)
    raise AttributeError(name)
