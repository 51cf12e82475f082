"""KVarN on a CUDA GPU (run where one is lent; the CPU tests run the same kernels in Triton's interpreter).

`kernels` section: parity of the plugin's Triton kernels (plugins/vllm/qconv_vllm/kvarn_triton.py, kvarn_attention.py) with qconv.kv's
codec on random tiles at D=256 G=128 (k4v2, k4v4), and decode_attention's time at 32K and 128K context in the 27B
shape (Hq 24, Hkv 4, D 256, one sequence) against torch SDPA over fp16 K/V and over fp8 K/V cast to fp16 per call.
`backend` section: the plugin's vLLM attention backend itself (KVarNAttentionImpl, the code vLLM calls per layer,
driven with vLLM's metadata shape but without vLLM, whose CUDA wheel is too large to carry to a lent machine): one
27B attention layer prefilling 4,096 new tokens onto a 28K / 124K-token cache and decoding 32 steps at 32K and 128K,
against torch SDPA over fp16 and fp8-cast K/V of the same length. Target on the GPU: decode within 10% of fp8,
prefill at least 0.8x fp8. Prints one JSON line; without CUDA it prints {"error": ...} and exits 2.

    python bench/gpu_kvarn.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "vllm")]

D, G, HQ, HKV = 256, 128, 24, 4


def _tiles(n: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(0)
    spread = 0.2 + 4 * torch.rand(1, 1, D, device=dev, generator=gen) ** 4  # a few outlier channels
    k = torch.randn(n, G, D, device=dev, generator=gen) * spread
    return k.half(), torch.randn(n, G, D, device=dev, generator=gen).half()


def _timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # microseconds


def _parity(kb: int, vb: int, dev: str) -> dict:
    from qconv.kv.kvarn import kvarn
    from qconv.kv.packing import unpack_bits
    from qconv_vllm import kvarn_attention
    from qconv_vllm import kvarn_triton as kt

    scheme = kvarn(kb, vb, G)
    k, v = _tiles(64, dev)
    rec, ref = kt.encode_tiles(k, v, kb, vb), scheme.encode(k.float(), v.float())
    got, want = scheme.layout(D).split(rec), scheme.layout(D).split(ref)
    out = {"records_equal": bool(torch.equal(rec, ref)), "bytes_equal": float((rec == ref).float().mean())}
    for name in want:
        if name.endswith("codes"):
            bits = kb if name[0] == "k" else vb
            differ = unpack_bits(got[name], bits) != unpack_bits(want[name], bits)
            out[f"{name}_differ"] = float(differ.float().mean())
        else:
            a, b = got[name].contiguous().view(torch.int16).int(), want[name].contiguous().view(torch.int16).int()
            out[f"{name}_max_ulps"] = int((a - b).abs().max())
    # decode attention: 2 sequences (30 closed tiles + 77 tokens; no closed tile + 5 tokens) vs fp32 attention
    pool = ref.view(16, HKV, -1)
    table = torch.arange(32, device=dev, dtype=torch.int32).remainder(16).view(1, 32).repeat(2, 1)
    n_closed = torch.tensor([30, 0], device=dev, dtype=torch.int32)
    sink = torch.tensor([G, G], device=dev, dtype=torch.int32)
    cur = torch.tensor([77, 5], device=dev, dtype=torch.int32)
    sk, sv = (x.view(2, 2, HKV, G, D) for x in _tiles(2 * 2 * HKV, dev))
    q = torch.randn(2, HQ, D, device=dev)
    o = kvarn_attention.decode_attention(q, pool, table, n_closed, sk, sv, sink, cur, kb, vb, G, D**-0.5)
    tk, tv = scheme.decode(pool.transpose(0, 1), D)  # [Hkv, 16, G, D]
    err = 0.0
    for b in range(2):
        ids = table[b, 1 : 1 + int(n_closed[b])].long()
        kk = torch.cat([sk[b, 0, :, :G].float(), tk[:, ids].flatten(1, 2), sk[b, 1, :, : int(cur[b])].float()], 1)
        vv = torch.cat([sv[b, 0, :, :G].float(), tv[:, ids].flatten(1, 2), sv[b, 1, :, : int(cur[b])].float()], 1)
        kk, vv = kk.repeat_interleave(HQ // HKV, 0), vv.repeat_interleave(HQ // HKV, 0)
        p = torch.softmax((q[b].unsqueeze(1) @ kk.transpose(1, 2)).squeeze(1) * D**-0.5, -1)
        err = max(err, float(((p.unsqueeze(1) @ vv).squeeze(1) - o[b]).abs().max()))
    out["attention_max_abs"] = err
    return out


def _speed(ctx: int, kb: int, vb: int, dev: str) -> dict:
    from qconv_vllm import kvarn_attention
    from qconv_vllm import kvarn_triton as kt

    n_closed = ctx // G - 1  # sink + closed tiles; the tile being filled holds G/2 more tokens
    k, v = _tiles(16 * HKV, dev)
    recs = kt.encode_tiles(k, v, kb, vb).view(16, HKV, -1)
    pool = recs.repeat((n_closed + 16) // 16, 1, 1)
    table = torch.arange(n_closed + 1, device=dev, dtype=torch.int32).view(1, -1)
    sk, sv = (x.view(1, 2, HKV, G, D) for x in _tiles(2 * HKV, dev))
    one = lambda x: torch.tensor([x], device=dev, dtype=torch.int32)  # noqa: E731
    q = torch.randn(1, HQ, D, device=dev, dtype=torch.float16)
    length = G + n_closed * G + G // 2
    kvarn_us = _timed(
        lambda: kvarn_attention.decode_attention(
            q, pool, table, one(n_closed), sk, sv, one(G), one(G // 2), kb, vb, G, D**-0.5
        )
    )
    kf = torch.randn(1, HKV, length, D, device=dev, dtype=torch.float16)
    vf = torch.randn_like(kf)
    k8, v8 = kf.to(torch.float8_e4m3fn), vf.to(torch.float8_e4m3fn)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qq = q.view(1, HQ, 1, D)
    fp16_us = _timed(lambda: sdpa(qq, kf, vf, enable_gqa=True))
    fp8_us = _timed(lambda: sdpa(qq, k8.to(torch.float16), v8.to(torch.float16), enable_gqa=True))
    return {
        "context": length,
        "kvarn_us": round(kvarn_us, 1),
        "sdpa_fp16_us": round(fp16_us, 1),
        "sdpa_fp8_cast_us": round(fp8_us, 1),
        "kvarn_bytes_per_layer": pool[:n_closed].numel(),
        "fp8_bytes_per_layer": k8.numel() * 2,
    }


def kernel_section() -> dict:
    """Parity and decode timing of the KVarN Triton kernels on the current CUDA device."""
    dev, t0 = "cuda", time.perf_counter()
    out = {"parity_k4v2": _parity(4, 2, dev), "parity_k4v4": _parity(4, 4, dev)}
    for ctx in (32 * 1024, 128 * 1024):
        out[f"decode_{ctx // 1024}k_k4v2"] = _speed(ctx, 4, 2, dev)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _sdpa_us(q, k, v) -> float:
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return _timed(lambda: F.scaled_dot_product_attention(q, k, v))


def backend_section() -> dict:
    """Prefill and decode through the backend's forward at 32K and 128K (one layer, one sequence)."""
    from qconv_vllm.kvarn_backend import KVarNAttentionImpl, KVarNMetadata

    dev, out, t0 = "cuda", {}, time.perf_counter()
    for ctx in (32 * 1024, 128 * 1024):
        impl = KVarNAttentionImpl(HQ, D, D**-0.5, HKV, kv_cache_dtype="kvarn_k4v2_g128")
        tiles = ctx // G + 1
        pool = torch.zeros(tiles, HKV, G, impl.codec.bytes_per_token, dtype=torch.uint8, device=dev)
        table = torch.arange(tiles, dtype=torch.int32, device=dev)[None]
        new = 4096
        fill = ctx - new

        def step(start: int, n: int, written: int):
            m = KVarNMetadata(n, [0, n], [start + n], table, [0], [start == 0], [written], 1)
            q = torch.randn(n, HQ * D, device=dev, dtype=torch.bfloat16)
            kv = torch.randn(n, HKV * D, device=dev, dtype=torch.bfloat16)
            return lambda: impl.forward(None, q, kv, kv, pool, m)

        step(0, fill, 0)()  # the cache up to the prefill
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(fill, new, fill)()
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t
        decode_us = _timed(step(ctx, 1, ctx), iters=32)  # re-writes the same position: a steady decode step
        q1 = torch.randn(1, HQ, 1, D, device=dev, dtype=torch.float16)
        kf = torch.randn(1, HKV, ctx, D, device=dev, dtype=torch.float16)
        qp = torch.randn(1, HQ, new, D, device=dev, dtype=torch.float16)
        fp16_decode = _sdpa_us(q1, kf, kf)
        fp8_decode = _sdpa_us_cast(q1, kf)
        fp16_prefill = _sdpa_us(qp, kf, kf) / 1e6
        out[f"{ctx // 1024}k"] = {
            "kvarn_prefill_tok_s": round(new / prefill_s),
            "fp16_sdpa_prefill_tok_s": round(new / fp16_prefill),
            "kvarn_decode_us": round(decode_us, 1),
            "fp16_sdpa_decode_us": round(fp16_decode, 1),
            "fp8_cast_sdpa_decode_us": round(fp8_decode, 1),
        }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _sdpa_us_cast(q, k):
    """SDPA over fp8-rounded K/V held as fp16 (the casts not timed): a lower bound on an fp8 cache's attention."""
    k8 = k.to(torch.float8_e4m3fn)
    return _sdpa_us(q, k8.to(torch.float16), k8.to(torch.float16))


def main() -> int:
    if not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "bench": "gpu_kvarn",
                    "error": "no CUDA device: this benchmark needs a GPU (the kernels "
                    "are tested on CPU by tests/test_kvarn_triton.py under TRITON_INTERPRET=1)",
                }
            )
        )
        return 2
    report = {"bench": "gpu_kvarn", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["kernels"] = kernel_section()
    report["backend"] = backend_section()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
