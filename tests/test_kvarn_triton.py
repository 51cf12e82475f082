"""The KVarN Triton kernels of the vLLM plugin against qconv.kv's codec, on this CPU under TRITON_INTERPRET=1.

Encode follows kvarn.py op by op (same torch matmul for the rotation); its sums run in numpy's order, not torch's
BLAS order. With the balance in float32 that moved a scale by an fp16 ulp or a code by a step in about 1 record of
10 (2 of these 6 random cases failed byte equality); the codecs now balance in float64 and take each exp in float64
(qconv.kv.kvarn.BALANCE_DTYPE), and the records are asserted byte for byte equal, random and SmolLM2 tiles alike.
The attention (kvarn_attention.attention, one query per sequence here; verifies and prefill chunks are in
tests/test_kvarn_vllm_codec.py) vs fp32 softmax attention over TileScheme.decode's K/V: max abs difference 1.7e-6
with fp32 output (|out| up to 3.5), 9.5e-4 with fp16 output (its rounding); asserted at 1e-4 (+1e-3 relative for
fp16 output). The work-memory bound and the planner's copy of it, and bench/gpu_day.py's CPU form, are here too.
On CUDA the same comparisons run in bench/gpu_day.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors
pytest.importorskip("triton", reason="triton is not installed in this environment (pip install triton==3.9.0)")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm"))
from qconv.kv.kvarn import kvarn  # noqa: E402
from qconv_vllm import kvarn_attention  # noqa: E402  (imports neither vLLM nor qconv)
from qconv_vllm import kvarn_triton as kt  # noqa: E402

ATTN_TOL = 1e-4
CASES = [(64, 64, 4, 2), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 2), (256, 64, 4, 2), (256, 128, 4, 4)]


def _tiles(n: int, g: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tiles with outlier channels and a token offset (what the rotation and balancing are for)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, g, d, generator=gen) * (0.2 + 4 * torch.rand(1, 1, d, generator=gen) ** 4) + 0.5
    v = torch.randn(n, g, d, generator=gen) * (0.5 + torch.rand(n, g, 1, generator=gen))
    return k.half(), v.half()


def assert_records_equal(rec: torch.Tensor, ref: torch.Tensor, d: int, g: int, kb: int, vb: int) -> None:
    """Byte for byte; a mismatch names the fields that differ and how many of their bytes do."""
    assert rec.shape == ref.shape and rec.dtype == torch.uint8
    if not torch.equal(rec, ref):
        got, want = kvarn(kb, vb, g).layout(d).split(rec), kvarn(kb, vb, g).layout(d).split(ref)
        diff = {name: int((got[name] != want[name]).sum()) for name in want if not torch.equal(got[name], want[name])}
        pytest.fail(f"records differ (D={d} G={g} k{kb}v{vb}, {rec.shape[0]} tiles): bytes per field {diff}")


@pytest.mark.parametrize("d,g,kb,vb", CASES)
def test_encode_matches_qconv_records_random(d, g, kb, vb):
    k, v = _tiles(8, g, d, seed=d + g + vb)
    rec = kt.encode_tiles(k, v, kb, vb)
    assert_records_equal(rec, kvarn(kb, vb, g).encode(k.float(), v.float()), d, g, kb, vb)


def test_record_bytes_are_the_layout_not_a_power_of_two():
    rb = kt.record_bytes(256, 128, 4, 4)
    assert rb == kvarn(4, 4, 128).record_bytes(256) == 35_072  # 32,768 B of codes + 2,304 B of fp16 scales
    assert rb & (rb - 1)  # not a power of two (the fp8-priced padding bug elsewhere)
    assert rb < 128 * 2 * 256  # fp8 K+V bytes of one tile of one head
    for d, g, kb, vb in CASES:
        assert kt.record_bytes(d, g, kb, vb) == kvarn(kb, vb, g).record_bytes(d)


def _reference_attention(q, pool, table, n_closed, stage_k, stage_v, sink, cur, kb, vb, g, scale):
    """fp32 softmax attention over [sink | TileScheme.decode of the closed tiles | tile being filled]."""
    scheme, out = kvarn(kb, vb, g), []
    hq, d, hkv = q.shape[1], q.shape[2], pool.shape[1]
    for b in range(q.shape[0]):
        ks, vs = [stage_k[b, 0, :, : int(sink[b])].float()], [stage_v[b, 0, :, : int(sink[b])].float()]
        if n_closed[b]:
            recs = pool[table[b, 1 : 1 + int(n_closed[b])].long()]  # [n, Hkv, RB]
            tk, tv = scheme.decode(recs.transpose(0, 1), d)  # [Hkv, n, G, D]
            ks, vs = ks + [tk.flatten(1, 2)], vs + [tv.flatten(1, 2)]
        ks.append(stage_k[b, 1, :, : int(cur[b])].float())
        vs.append(stage_v[b, 1, :, : int(cur[b])].float())
        kk, vv = torch.cat(ks, 1).repeat_interleave(hq // hkv, 0), torch.cat(vs, 1).repeat_interleave(hq // hkv, 0)
        p = torch.softmax((q[b].float().unsqueeze(1) @ kk.transpose(1, 2)).squeeze(1) * scale, -1)
        out.append((p.unsqueeze(1) @ vv).squeeze(1))
    return torch.stack(out)


def _cache(n_closed: list[int], cur: list[int], hq: int, hkv: int, d: int, g: int, kb: int, vb: int, seed: int):
    """A pool with shuffled blocks (and unused ones), a block table wider than needed, sink + current stages."""
    gen = torch.Generator().manual_seed(seed)
    bsz, total = len(n_closed), sum(n_closed)
    k, v = _tiles(max(total, 1) * hkv, g, d, seed)
    recs = kvarn(kb, vb, g).encode(k.float(), v.float()).view(max(total, 1), hkv, -1)
    pool = torch.zeros(total + 3, hkv, recs.shape[-1], dtype=torch.uint8)
    perm = torch.randperm(total + 3, generator=gen)[:total]
    pool[perm] = recs[:total]
    table = torch.full((bsz, max(n_closed) + 3), 10**6, dtype=torch.int32)  # unused slots point nowhere
    for b, off in enumerate(torch.tensor([0] + n_closed).cumsum(0)[:-1].tolist()):
        table[b, 1 : 1 + n_closed[b]] = perm[off : off + n_closed[b]].int()
    sk, sv = _tiles(bsz * 2 * hkv, g, d, seed + 1)
    sink = torch.tensor([g if n or c else max(c, 1) for n, c in zip(n_closed, cur)], dtype=torch.int32)
    q = torch.randn(bsz, hq, d, generator=gen).half()
    return (
        q,
        pool,
        table,
        torch.tensor(n_closed, dtype=torch.int32),
        sk.view(bsz, 2, hkv, g, d),
        sv.view(bsz, 2, hkv, g, d),
        sink,
        torch.tensor(cur, dtype=torch.int32),
    )


def _attention(q, pool, table, n_closed, stage_k, stage_v, sink, cur, kb, vb, g, scale, splits=None):
    """kvarn_attention.attention over _cache's sequences, one query each at its last position: the exact run is
    the sink then the tile being filled (at positions (n_closed + 1) G onwards)."""
    lens = sink + n_closed * g + cur
    ks, vs, pos, start = [], [], [], [0]
    for b in range(q.shape[0]):
        s, c, first = int(sink[b]), int(cur[b]), (int(n_closed[b]) + 1) * g
        ks += [stage_k[b, 0, :, :s], stage_k[b, 1, :, :c]]
        vs += [stage_v[b, 0, :, :s], stage_v[b, 1, :, :c]]
        pos += [*range(s), *range(first, first + c)]
        start.append(start[-1] + s + c)
    return kvarn_attention.attention(
        q,
        pool,
        table,
        lens,
        torch.arange(q.shape[0] + 1, dtype=torch.int32),
        torch.cat(ks, 1),
        torch.cat(vs, 1),
        torch.tensor(pos, dtype=torch.int32),
        torch.tensor(start, dtype=torch.int32),
        kb,
        vb,
        g,
        scale,
        splits,
    )


@pytest.mark.parametrize(
    "d,g,kb,vb,hq,hkv,splits",
    [(64, 64, 4, 2, 4, 2, 2), (128, 64, 4, 4, 2, 1, None), (256, 128, 4, 2, 3, 1, 3), (64, 128, 4, 4, 6, 2, 1)],
)
def test_decode_attention_matches_reference(d, g, kb, vb, hq, hkv, splits):
    # sequences: n_closed 0 with a short sink, partial current tiles at 0, mid and G-1 tokens
    args = _cache([0, 3, 1, 2], [0, g // 2, g - 1, 5], hq, hkv, d, g, kb, vb, seed=d + g)
    args[6][0] = 7  # sequence 0: only 7 sink tokens
    out = _attention(*args, kb, vb, g, d**-0.5, splits)
    ref = _reference_attention(*args, kb, vb, g, d**-0.5)
    assert out.shape == ref.shape and out.dtype == torch.float16
    err = float((out.float() - ref).abs().max())
    assert err < ATTN_TOL + 1e-3 * float(ref.abs().max()), err  # fp16 output: half an ulp at |out| ~ 1 is 5e-4
    out32 = _attention(args[0].float(), *args[1:], kb, vb, g, d**-0.5, splits)
    assert float((out32 - ref).abs().max()) < ATTN_TOL


def test_decode_attention_long_context_many_splits():
    """64 closed tiles over 8 splits (and 24 splits, most of them past the sequence's end): no NaN, same result."""
    d, g = 64, 64
    args = _cache([64, 0], [17, 0], 2, 1, d, g, 4, 2, seed=3)
    ref = _reference_attention(*args, 4, 2, g, d**-0.5)
    for splits in (8, 24):
        out = _attention(args[0].float(), *args[1:], 4, 2, g, d**-0.5, splits)
        assert torch.isfinite(out).all()
        assert float((out - ref).abs().max()) < ATTN_TOL


def test_attention_rejects_a_wrong_pool():
    args = list(_cache([1], [3], 2, 1, 64, 64, 4, 2, seed=0))
    args[1] = args[1][..., :-8]
    with pytest.raises(ValueError, match="pool must be uint8"):
        _attention(*args, 4, 2, 64, 0.125)


def test_work_memory_grows_with_the_batch_not_the_context():
    """The bound the planner and the backend's reservation use: linear in query tokens, free of context."""
    w = kvarn_attention.work_bytes
    assert w(2048, 4, 24, 4, 256, 128) < 2.2 * w(1024, 4, 24, 4, 256, 128)
    assert kvarn_attention.num_splits(1, 2048) == 64 and kvarn_attention.num_splits(2048, 2048) == 1
    assert w(2048, 4, 24, 4, 256, 128) < 400 * 2**20  # 2,048-token chunk of the 27B: 258 MiB, at any context


def _smollm2_kv(smollm2: Path, text: str, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE K and V of every layer of SmolLM2 (head_dim 64) over `tokens` tokens: [Hkv, T, 64] each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:tokens]])
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


@pytest.mark.slow
def test_encode_matches_qconv_records_on_smollm2_kv(smollm2, shared_data, one_thread):
    """Real K/V: SmolLM2's layers at D=64; at D=128/256 each KV head's channels of 2/4 consecutive layers are
    concatenated (real values and outlier channels, though no model has exactly that head)."""
    text = (shared_data / "wikitext-2-raw-test.txt").read_text()[100_000:120_000]
    kv = _smollm2_kv(smollm2, text, 256)
    for d, g, kb, vb, first in [
        (64, 64, 4, 2, 0),
        (64, 64, 4, 4, len(kv) - 1),
        (128, 128, 4, 4, 14),
        (256, 128, 4, 4, 4),
        (256, 64, 4, 2, len(kv) - 4),
    ]:
        k, v = (torch.cat([kv[i][j] for i in range(first, first + d // 64)], -1).half() for j in (0, 1))
        k, v = (x.unflatten(1, (-1, g)).flatten(0, 1) for x in (k, v))  # [Hkv * T/g, g, d]
        rec = kt.encode_tiles(k, v, kb, vb)
        assert_records_equal(rec, kvarn(kb, vb, g).encode(k.float(), v.float()), d, g, kb, vb)


def _gpu_day(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if not interpret:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_day.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_gpu_day_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench/gpu_day.py would run for real")
    r = _gpu_day()
    assert r.returncode == 2, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["bench"] == "gpu_day" and "no CUDA" in line["error"]
    r = _gpu_day("--parts", "kernels,bogus")
    assert r.returncode == 2 and "bogus" in json.loads(r.stdout)["error"]


@pytest.mark.slow
def test_gpu_day_kvarn_parts_run_here_at_small_shapes():
    """The device script's KVarN parts on this CPU (Triton interpreted, tiny shapes): one JSON line a part, the
    Triton path of the backend equal to its torch path, the build part saying it is left out."""
    r = _gpu_day("--device", "cpu", "--small", "--repeat", "1", "--parts", "kernels,backend,build", interpret=True)
    rows = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert [x["part"] for x in rows] == ["kernels", "backend", "build"]
    assert rows[0]["pass"] and rows[1]["pass"] and 0 < rows[1]["max_abs_vs_cpu"] < 1e-3
    assert "skipped" in rows[2]


@pytest.mark.slow
def test_gpu_day_bench_part_runs_qconv_bench_from_the_carried_wheels():
    """The device script's bench part on this CPU: the server chain unpacked from the carried wheels, `qconv bench`
    on our engine over the four workloads at two levels, no request failed."""
    _fetched_wheels()
    r = _gpu_day("--device", "cpu", "--small", "--parts", "bench")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["pass"] and "--device cpu" in row["command"]
    assert sorted(row["cells"]) == sorted(f"{w}_c{c}" for w in ("copy", "code", "chat", "math") for c in (1, 2))


def _fetched_wheels() -> list[Path]:
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_day_bench import fetch_wheels, requirements, wheel_files

    files = wheel_files()
    if len({f.name.split("-")[0] for f in files}) < len(requirements()):
        files = fetch_wheels()
    return files


def test_gpu_day_carried_wheels_fit_and_are_the_tested_versions():
    """What a device session carries for bench/gpu_day.py: the versions this suite runs, 40 MiB in all at most."""
    from importlib.metadata import version

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_day_bench import requirements

    for req in requirements():
        name, pinned = req.split("==")
        assert version(name) == pinned, f"bench/gpu_day_wheels.txt pins {req}, the suite runs {version(name)}"
    assert sum(f.stat().st_size for f in _fetched_wheels()) <= 40 * 2**20


def test_planner_counts_the_backends_work_memory():
    """qconv plan's KVarN work memory is the plugin's: its staging buffers (slot_capacity x 3 tiles) and
    kvarn_attention.work_bytes for the batch vLLM profiles, at the 27B's shapes and a small one."""
    from qconv_vllm.kvarn_backend import KVarNAttentionImpl

    for layers, hq, hkv, d, seqs, tokens, g in [(16, 24, 4, 256, 1, 2048, 128), (3, 4, 2, 64, 8, 512, 64)]:
        impl = KVarNAttentionImpl(hq, d, d**-0.5, hkv, kv_cache_dtype=f"kvarn_k4v2_g{g}")
        impl.reserve(seqs, "cpu")  # what vLLM's layer construction allocates
        plugin = layers * impl.stage.nbytes + kvarn_attention.work_bytes(tokens, seqs, hq, hkv, d, g)
        assert kvarn(4, 2, g).serving_work_bytes(layers, hq, hkv, d, seqs, tokens) == plugin
