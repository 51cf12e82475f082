"""Packed KV stores: appends in any chunking equal the one-shot simulation, rollback, runtime adapter."""

import pytest
import torch

from qconv.kv import get_kv_scheme
from qconv.kv.store import PackedKV

pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).half(), torch.randn(*shape, generator=g).half()


@pytest.mark.parametrize(
    "name", ["kvarn_k4v2_g64", "kvarn_k4v4_g256", "kivi_k4v4_g128", "int4_g32", "int8_token", "bf16"]
)
def test_store_matches_fake_quant_for_any_chunking(name):
    s = get_kv_scheme(name)
    t = 845  # g256: sink + 2 tiles + 77 in progress
    k, v = _kv(2, 3, t, 64)  # [layers, heads, tokens, D]
    want_k, want_v = s.fake_quant(k, v)
    for chunks in ([t], [1] * 5 + [60, 7, 200, 61, 512], [64, 64, 205, 255, 257]):
        st, i = PackedKV(s, 64), 0
        for c in chunks:
            st.append(k[..., i : i + c, :], v[..., i : i + c, :])
            i += c
        got_k, got_v = st.dequantize(torch.float16)
        assert st.length == t
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), chunks
        assert st.nbytes == 2 * 3 * s.stored_bytes_per_head(t, 64)


def test_store_holds_packed_records_of_the_stated_size():
    s = get_kv_scheme("kvarn_k4v2_g128")
    k, v = _kv(4, 5 * 128 + 17, 128)
    st = PackedKV(s, 128)
    st.append(k, v)
    assert st.records.dtype == torch.uint8 and st.n_tiles == 4
    assert st.records[..., : st.n_tiles, :].shape == (4, 4, 13824)
    fp16 = k.numel() * 2 * 2
    assert st.nbytes == 4 * (4 * 13824 + (128 + 17) * 128 * 2 * 2)
    assert st.nbytes < fp16 / 2.2


def test_rollback_inside_the_newest_tile_is_exact():
    s = get_kv_scheme("kvarn_k4v2_g64")
    k, v = _kv(2, 200, 64, seed=1)
    st = PackedKV(s, 64, keep_last_tile=True)
    st.append(k[:, :190], v[:, :190])  # sink + 1 quantized tile (64..127) + 62 in progress
    st.append(k[:, 190:200], v[:, 190:200])  # fills tile 128..191 -> quantized
    st.truncate(185)  # back inside the newest quantized tile: exact values come back
    st.append(k[:, 185:200], v[:, 185:200])
    want = s.fake_quant(k, v)
    got = st.dequantize(torch.float16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert st.lossy_rollbacks == 0
    st.truncate(100)  # two tiles back: the tile is decoded (lossy), and counted
    assert st.lossy_rollbacks == 1 and st.length == 100 and st.dequantize()[0].shape == (2, 100, 64)
    st.truncate(10)  # into the sink: exact
    assert torch.equal(st.dequantize(torch.float16)[0], k[:, :10])


ONE_TILE = 2 * 3 * (2 * 2 * 64 * 64 * 4)  # layers x slots x (K+V x heads x tile x D x fp32): one decoded tile each


@pytest.mark.parametrize("decoded_cache_bytes", [0, ONE_TILE, 1 << 30])  # off, one tile per sequence, all
def test_runtime_adapter_follows_kvstore_protocol(decoded_cache_bytes):
    s = get_kv_scheme("kvarn_k4v4_g64")
    store = s.new_store(
        layers=2,
        max_batch=3,
        max_len=512,
        heads=2,
        head_dim=64,
        dtype=torch.float32,
        decoded_cache_bytes=decoded_cache_bytes,
    )
    k, v = _kv(2, 300, 2, 64, seed=2)  # [B, T, H, D] as the runtime writes: sink + 3 tiles + 44
    store.write(1, [0, 2], [0, 0], k[:, :100], v[:, :100])
    store.write(1, [0, 2], [100, 100], k[:, 100:], v[:, 100:])
    rk, rv = store.read(1, [2, 0], 310)
    assert rk.shape == (2, 2, 310, 64) and torch.equal(rk[:, :, 300:], torch.zeros_like(rk[:, :, 300:]))
    want_k, _ = s.fake_quant(k.transpose(1, 2), v.transpose(1, 2))
    assert torch.equal(rk[1, :, :300].half(), want_k[0]) and torch.equal(rk[0, :, :300].half(), want_k[1])
    assert torch.equal(store.read(1, [0], 150)[0][0].half(), want_k[0][:, :150])  # a prefix: no tile past it decoded
    store.truncate([0], [250])
    store.write(1, [0], [250], k[:1, 250:], v[:1, 250:])
    assert torch.equal(store.read(1, [0], 300)[0][0].half(), want_k[0])
    # roll back into the newest quantized tile and write other values: a decoded cache must not serve the old ones
    k2, v2 = torch.cat([k[:1, :200], -k[:1, 200:]], 1), torch.cat([v[:1, :200], -v[:1, 200:]], 1)
    store.truncate([0], [200])
    store.write(1, [0], [200], k2[:, 200:], v2[:, 200:])
    assert torch.equal(store.read(1, [0], 300)[0][0].half(), s.fake_quant(k2.transpose(1, 2), v2.transpose(1, 2))[0][0])
    assert store.nbytes == 2 * 2 * s.stored_bytes_per_head(300, 64)  # the decoded cache is not in the bound
    held = {0: 0, ONE_TILE: 1, 1 << 30: 3}[decoded_cache_bytes]  # decoded tiles per sequence
    assert store.seqs[1][0].n_dec == store.seqs[1][2].n_dec == held
    assert store.decoded_nbytes <= decoded_cache_bytes and (store.decoded_nbytes > 0) == (held > 0)


def test_decoded_tile_cache_decodes_only_new_tiles():
    from dataclasses import fields

    s, calls = get_kv_scheme("kvarn_k4v2_g64"), []

    class Counting(type(s)):
        def decode(self, rec, head_dim, dtype=torch.float32):
            calls.append(rec.shape[-2])
            return super().decode(rec, head_dim, dtype)

    cs = Counting(**{f.name: getattr(s, f.name) for f in fields(s)})
    k, v = _kv(2, 7 * 64 + 5, 64, seed=3)
    st = PackedKV(cs, 64, decoded_tiles=100)
    st.append(k[:, : 6 * 64], v[:, : 6 * 64])  # sink + 5 tiles
    first = st.dequantize(torch.float16)
    st.append(k[:, 6 * 64 :], v[:, 6 * 64 :])  # one more tile + 5 in progress
    second = st.dequantize(torch.float16)
    st.dequantize(torch.float16)
    assert calls == [5, 1]  # each closed tile decoded once
    assert torch.equal(second[0][:, : 6 * 64], first[0]) and torch.equal(second[0], s.fake_quant(k, v)[0])
