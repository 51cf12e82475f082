"""The qconv-vllm KVarN backend's torch path against qconv's own KVarN (no vLLM needed): the plugin's codec writes
the same records byte for byte, and its paged attention (sink + records + fp16 tiles, chunked prefill, decode,
speculative rollback, slots reused by new sequences) gives what `KVScheme.decode_time` says each query reads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from qconv.kv.kvarn import kvarn

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CUDA kernels' wiring runs on CPU tensors (numpy-simulated)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"))
from qconv_vllm import KVARN_PRESETS  # noqa: E402
from qconv_vllm.kvarn_backend import KVarNAttentionImpl  # noqa: E402
from qconv_vllm.kvarn_codec import Codec  # noqa: E402
from qconv_vllm.kvarn_metadata import SlotTable, host_lists, step_metadata  # noqa: E402

# Largest |plugin - simulation| of attention outputs measured over the prefill/decode cases: 3.3e-6 (float32 sums
# in another order)
ATOL = 1e-5


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("preset", KVARN_PRESETS)
def test_plugin_codec_writes_qconvs_records(preset, d):
    codec = Codec.from_dtype(preset, d)
    ref = kvarn(codec.k_bits, codec.v_bits, codec.tile)
    g = torch.Generator().manual_seed(d + codec.tile)
    # outlier channels and a few loud tokens, as real keys have
    k = (torch.randn(5, codec.tile, d, generator=g) * (1 + 8 * (torch.rand(d, generator=g) > 0.9))).half()
    k[:, 3] *= 20
    v = torch.randn(5, codec.tile, d, generator=g).half()
    rec = codec.encode(k, v)
    assert rec.shape == (5, ref.record_bytes(d)) and codec.record_bytes == ref.record_bytes(d)
    assert torch.equal(rec, ref.encode(k.float(), v.float()))
    kd, vd = codec.decode(rec)
    kr, vr = ref.decode(rec, d)
    assert torch.equal(kd, kr) and torch.equal(vd, vr)


def test_record_is_not_padded_to_a_power_of_two():
    """At head_dim 256 a power-of-two slot would make k4v4 cost what fp8 costs."""
    c = Codec.from_dtype("kvarn_k4v4_g128", 256)
    assert c.record_bytes == 35072 and c.bytes_per_token == 274 < 512  # fp8: 2 x 256 B per token and head
    assert Codec.from_dtype("kvarn_k4v2_g128", 256).bytes_per_token == 210  # 1/4.88 of bf16's 1,024


class NoSync(torch.Tensor):
    """A "device" tensor that refuses to be read by the host: what the backend's forward must never need."""

    @staticmethod
    def wrap(t: torch.Tensor) -> torch.Tensor:
        return t.as_subclass(NoSync)

    def _refuse(self, *args, **kwargs):
        raise AssertionError("host sync: a device tensor was read on the host")

    tolist = item = __bool__ = __int__ = __index__ = numpy = cpu = _refuse


class _Seq:
    """Drives one KVarN layer the way vLLM's runner does: a block table of tile ids, a slot table, steps."""

    def __init__(
        self, preset: str, d: int, hk: int, grp: int, n_blocks: int = 64, capacity: int = 6, kernels: bool = False
    ):
        self.impl = KVarNAttentionImpl(hk * grp, d, d**-0.5, hk, kv_cache_dtype=preset)
        self.impl.kernels = kernels  # the Triton attention (TRITON_INTERPRET=1 here) instead of the torch path
        c = self.impl.codec
        self.pool = torch.zeros(n_blocks, hk, c.tile, c.bytes_per_token, dtype=torch.uint8)
        self.table = SlotTable(capacity)
        self.hk, self.d = hk, d

    def step(self, reqs: list[tuple[int, list[int], int, torch.Tensor, torch.Tensor, torch.Tensor]]):
        """reqs: (first block id, block ids, start, q [T, H, D], k [T, hk, D], v) -> outputs per request."""
        qs = [0]
        for r in reqs:
            qs.append(qs[-1] + r[3].shape[0])
        lens = [r[2] + r[3].shape[0] for r in reqs]
        width = max(len(r[1]) for r in reqs)
        bt = NoSync.wrap(torch.tensor([r[1] + [0] * (width - len(r[1])) for r in reqs], dtype=torch.int32))
        m = step_metadata(self.table, qs, lens, [r[0] for r in reqs], bt, self.impl.codec.tile)
        m.ints = NoSync.wrap(m.ints)
        q = torch.cat([r[3] for r in reqs]).flatten(1)
        k = torch.cat([r[4] for r in reqs]).flatten(1)
        v = torch.cat([r[5] for r in reqs]).flatten(1)
        out = self.impl.forward(None, q, k, v, self.pool, m)
        return [out[a:b].view(b - a, -1, self.d) for a, b in zip(qs, qs[1:])]


def _reference(preset: str, q, k, v, scale):
    """Each query's attention over what qconv's runtime store holds at its own decode step."""
    c = Codec.from_dtype(preset, q.shape[-1])
    scheme = kvarn(c.k_bits, c.v_bits, c.tile)
    kk, vv, allowed = scheme.decode_time(k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # [1, hk, 2T, D]
    grp = q.shape[1] // k.shape[1]
    kk, vv = kk[0].repeat_interleave(grp, 0), vv[0].repeat_interleave(grp, 0)
    s = (q.transpose(0, 1) @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (s @ vv).transpose(0, 1)


@pytest.mark.parametrize("preset,d", [("kvarn_k4v2_g64", 64), ("kvarn_k4v4_g128", 128), ("kvarn_k4v2_g64", 256)])
def test_chunked_prefill_and_decode_match_the_decode_time_simulation(preset, d):
    torch.manual_seed(0)
    hk, grp = 2, 3
    seq = _Seq(preset, d, hk, grp)
    g = seq.impl.codec.tile
    t = 4 * g + 20
    q, k, v = torch.randn(t, hk * grp, d), torch.randn(t, hk, d) * 2, torch.randn(t, hk, d)
    k, v = k.half().float(), v.half().float()
    blocks = list(range(10, 10 + -(-t // g)))
    outs, pos = [], 0
    for n in (g + 7, 2 * g + 1, 1, 1, t - 3 * g - 10):  # a prefill that crosses the sink, one that closes tiles
        outs += seq.step([(blocks[0], blocks, pos, q[pos : pos + n], k[pos : pos + n], v[pos : pos + n])])
        pos += n
    got = torch.cat(outs)
    want = _reference(preset, q[:pos], k[:pos], v[:pos], d**-0.5)
    assert torch.allclose(got, want, atol=ATOL), float((got - want).abs().max())


@pytest.mark.parametrize("kernels", [False, True])
def test_speculative_rollback_into_a_closed_tile_reads_its_fp16_copy(kernels):
    """A draft that closed a tile and was then rejected: the next write starts inside that tile again (torch path
    and the Triton attention, interpreted)."""
    torch.manual_seed(1)
    preset, d, hk, grp = "kvarn_k4v2_g64", 64, 1, 2
    seq = _Seq(preset, d, hk, grp, kernels=kernels)
    t = 200
    q, k, v = torch.randn(t, hk * grp, d), torch.randn(t, hk, d).half().float(), torch.randn(t, hk, d).half().float()
    blocks = list(range(4))
    seq.step([(0, blocks, 0, q[:126], k[:126], v[:126])])
    # a verify step of 5 tokens closes tile 1 (64..127); only the first is accepted, 127..130 were rejected drafts
    junk = torch.randn(4, hk, d)
    seq.step([(0, blocks, 126, q[126:131], torch.cat([k[126:127], junk]), torch.cat([v[126:127], junk]))])
    out = seq.step([(0, blocks, 127, q[127:t], k[127:t], v[127:t])])[0]
    want = _reference(preset, q[:t], k[:t], v[:t], d**-0.5)[127:]
    assert torch.allclose(out, want, atol=ATOL), float((out - want).abs().max())


def test_batched_sequences_and_reused_blocks_equal_one_by_one():
    """Requests come and go: a finished request's blocks (and staging slot) go to a new one, which must not see
    the old one's tokens; batched outputs equal each sequence run alone."""
    torch.manual_seed(2)
    preset, d, hk, grp = "kvarn_k4v2_g64", 64, 2, 2
    data = [tuple(torch.randn(t, h, d) for h in (hk * grp, hk, hk)) for t in (150, 90, 170)]
    alone = []
    for q, k, v in data:
        s = _Seq(preset, d, hk, grp)
        outs = s.step([(0, [0, 1, 2], 0, q[:100], k[:100], v[:100])])
        if q.shape[0] > 100:
            outs += s.step([(0, [0, 1, 2], 100, q[100:], k[100:], v[100:])])
        alone.append(torch.cat(outs))
    both = _Seq(preset, d, hk, grp, capacity=2)
    (qa, ka, va), (qb, kb, vb), (qc, kc, vc) = data
    a0, b0 = both.step([(0, [0, 1, 2], 0, qa[:100], ka[:100], va[:100]), (3, [3, 4], 0, qb, kb, vb)])
    a1 = both.step([(0, [0, 1, 2], 100, qa[100:], ka[100:], va[100:])])[0]  # b has finished; c takes its blocks
    (c0,) = both.step([(3, [3, 4, 5], 0, qc[:100], kc[:100], vc[:100])])
    (c1,) = both.step([(3, [3, 4, 5], 100, qc[100:], kc[100:], vc[100:])])
    for got, want in ((torch.cat([a0, a1]), alone[0]), (b0, alone[1]), (torch.cat([c0, c1]), alone[2])):
        assert torch.allclose(got, want, atol=ATOL), float((got - want).abs().max())


def test_kernel_path_at_the_27b_head_layout_matches_the_simulation():
    """The Triton attention the backend runs on CUDA (here under TRITON_INTERPRET=1), at the 27B's 24 query / 4 KV
    heads, D=256, tile 128, on mixed batches: a prefill crossing the sink and one closing a tile, a decode,
    5-token verifies (one of them across a tile's end), all against what each query reads at its decode step."""
    pytest.importorskip("triton")
    torch.manual_seed(4)
    preset, d, hk, grp = "kvarn_k4v2_g128", 256, 4, 6
    seq = _Seq(preset, d, hk, grp, n_blocks=12, kernels=True)
    lens = (264, 134)
    data = [
        (torch.randn(t, hk * grp, d), torch.randn(t, hk, d).half().float(), torch.randn(t, hk, d).half().float())
        for t in lens
    ]
    blocks = [[0, 5, 7], [3, 1]]
    # the first step (250 tokens of the first request) on the torch path, the rest on the kernels: a chunk that
    # closes tile 1 next to a prefill crossing the sink, then a 5-token verify next to a decode, then both verify
    steps = [((0, 250), None), ((250, 258), (0, 132)), ((258, 263), (132, 133)), ((263, 264), (133, 134))]
    outs: list[list[torch.Tensor]] = [[], []]
    for n, step in enumerate(steps):
        seq.impl.kernels = n > 0
        reqs = [
            (blocks[i][0], blocks[i], ab[0], *(x[ab[0] : ab[1]] for x in data[i])) for i, ab in enumerate(step) if ab
        ]
        for i, o in zip([i for i, ab in enumerate(step) if ab], seq.step(reqs)):
            outs[i].append(o)
    for i, (q, k, v) in enumerate(data):
        got, want = torch.cat(outs[i]), _reference(preset, q, k, v, d**-0.5)
        assert torch.allclose(got, want, atol=1e-4), (i, float((got - want).abs().max()))


def test_kernel_path_reads_the_same_cache_as_the_torch_path():
    """A batch of decodes through the Triton attention (TRITON_INTERPRET=1) equals the torch path on the same
    pool, staging slots and block table: sink only, closed tiles + a tile in progress, a tile just closed."""
    pytest.importorskip("triton")
    torch.manual_seed(3)
    preset, d, hk, grp = "kvarn_k4v2_g64", 64, 1, 2
    runs = []
    for kernels in (False, True):
        seq = _Seq(preset, d, hk, grp, n_blocks=16, kernels=kernels)
        gen = torch.Generator().manual_seed(5)
        reqs = []
        for i, n in enumerate((30, 3 * 64 + 5, 2 * 64)):
            blocks = list(range(5 * i, 5 * i + 5))
            q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hk * grp, hk, hk))
            seq.step([(blocks[0], blocks, 0, q[: n - 1], k[: n - 1], v[: n - 1])])
            reqs.append((blocks[0], blocks, n - 1, q[n - 1 :], k[n - 1 :], v[n - 1 :]))
        runs.append(torch.stack([o[0] for o in seq.step(reqs)]))
    assert torch.allclose(runs[1], runs[0], atol=1e-4), float((runs[1] - runs[0]).abs().max())


def test_builder_reads_vllms_cpu_copies_only():
    """The metadata builder's inputs: query_start_loc_cpu, seq_lens_cpu_upper_bound and req_idx (the v2 runner
    gives all three); the device tensors beside them refuse host reads."""
    import types

    import numpy as np

    dev = NoSync.wrap(torch.tensor([7, 9]))
    cam = types.SimpleNamespace(
        num_reqs=2,
        query_start_loc_cpu=torch.tensor([0, 5, 6, 6]),
        seq_lens_cpu_upper_bound=torch.tensor([130, 40, 0]),
        seq_lens=dev,
        req_idx=np.array([3, 0, 1]),
        block_table_tensor=NoSync.wrap(torch.zeros(3, 4, dtype=torch.int32)),
    )
    assert host_lists(cam, exact_cpu_lens=True) == ([0, 5, 6], [130, 40], [3, 0])
    with pytest.raises(AssertionError, match="host sync"):  # async spec decode: the exact lengths are read
        host_lists(cam, exact_cpu_lens=False)
    m = step_metadata(SlotTable(4), [0, 5, 6], [130, 40], [3, 0], cam.block_table_tensor[:2], 64)
    # request 0 (positions 125..129): its sink and tiles 1-2's tokens from 64 on (tile 1 closes at 127, inside the
    # step, so queries 125-126 read it in fp16); request 1: 40 tokens, all sink
    assert m.n_exact == 64 + 66 + 40 and m.ints[:170].tolist()[64:66] == [64, 65]


def test_profiling_forward_takes_the_work_memory(monkeypatch):
    """vLLM profiles without metadata: the layer's staging buffer exists from `reserve`, and the forward takes
    kvarn_attention.work_bytes for the profiled batch, so the profiler's peak includes both."""
    from qconv_vllm import kvarn_attention
    from qconv_vllm.kvarn_metadata import slot_capacity

    impl = KVarNAttentionImpl(24, 256, 256**-0.5, 4, kv_cache_dtype="kvarn_k4v2_g128")
    impl.reserve(3, "cpu")
    assert impl.stage.shape == (slot_capacity(3), 3, 2, 4, 128, 256) and impl.stage.dtype == torch.float16
    sizes, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (sizes.append(a), empty(*a, **k))[1])
    q = torch.zeros(16, 24 * 256)
    out = impl.forward(None, q, torch.zeros(16, 1024), torch.zeros(16, 1024), None, None)
    assert not out.any() and sizes == [(kvarn_attention.work_bytes(16, 3, 24, 4, 256, 128),)]
