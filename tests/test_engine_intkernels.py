"""Artifacts through torch's CPU int kernels (qconv/engine/int_linear.py) vs the dequantize-on-load path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qconv.engine import load_model
from qconv.engine.int_linear import Int4Linear, Int8Embedding, IntWeight, int4_supported, int_kernels_available
from qconv.errors import QconvError
from tests.test_engine_model import _quantize, _tokens

pytestmark = [
    pytest.mark.skipif(
        not int_kernels_available(torch.device("cpu"), torch.bfloat16), reason="this torch build has no CPU int4 kernel"
    ),
    pytest.mark.usefixtures("one_thread"),
]

# The 3090 SmolLM2 recipe's layout: int4 g64 attention + gate/up, int4 g128 down_proj, int8 g64 embedding + lm_head.
SMOLLM2_LAYOUT = {
    "int4": (["re:.*self_attn.*", "re:.*mlp\\.(gate|up)_proj$"], 4, 64),
    "down": (["re:.*mlp\\.down_proj$"], 4, 128),
    "int8": (["re:.*lm_head$", "re:.*embed_tokens$"], 8, 64),
}


@pytest.fixture(scope="module")
def tiny_artifact(tiny_qwen3, tmp_path_factory):
    return _quantize(tiny_qwen3, tmp_path_factory.mktemp("intk") / "q3", SMOLLM2_LAYOUT)


@pytest.fixture(scope="module")
def tiny35_artifact(tiny_qwen3_5, tmp_path_factory):
    """qwen3_5: int4 g64 for every Linear but the tiny GDN a/b projections (so the fused GDN in_proj stays dense)."""
    return _quantize(
        tiny_qwen3_5,
        tmp_path_factory.mktemp("intk35") / "q35",
        {"int4": (["Linear"], 4, 64), "int8": (["re:.*lm_head$"], 8, 64)},
        ignore=["re:.*in_proj_a$", "re:.*in_proj_b$"],
    )


@pytest.fixture(scope="module")
def zero_point_artifact(tiny_qwen3, tmp_path_factory):
    """The SmolLM2 layout with zero points on every int4 group (what `symmetric: false` builds write)."""
    return _quantize(
        tiny_qwen3, tmp_path_factory.mktemp("intkzp") / "q3zp", SMOLLM2_LAYOUT, asymmetric=("int4", "down")
    )


def _int4_modules(model) -> list[Int4Linear]:
    return [m for m in model.modules() if isinstance(m, Int4Linear)]


def test_effective_weights_equal_dequantized(tiny_artifact):
    """The int4 kernel's weights (kernel applied to the identity) and the int8 embedding rows are bit-identical to
    the dequantize-on-load weights; above `max_rows` rows the dense copy answers."""
    ints = load_model(tiny_artifact, dtype=torch.bfloat16)
    dense = load_model(tiny_artifact, dtype=torch.bfloat16, int_kernels=False, pack=False)
    mods = dict(ints.named_modules())
    swapped = {n: m for n, m in mods.items() if isinstance(m, Int4Linear)}
    assert len(swapped) == 4 * ints.config.num_layers  # qkv, o, gate_up, down per layer
    for name, m in swapped.items():
        w = dense.get_submodule(name).weight  # [N, K] bf16, compressed-tensors' decompress rounded to bf16
        eye = torch.eye(m.in_features, dtype=torch.bfloat16)
        assert torch.equal(m.int4_mm(eye).t(), w), name
        x = torch.randn(m.max_rows + 1, m.in_features).to(torch.bfloat16)
        assert torch.equal(m(x), m.dense(x))  # many rows: the dense path
        assert torch.equal(m(x[:1]), m.int4_mm(x[:1]))
    assert isinstance(ints.embed_tokens, Int8Embedding)
    every = torch.arange(ints.config.vocab_size)
    assert torch.equal(ints.embed_tokens(every), dense.embed_tokens.weight)
    # the integers and scales handed to the kernels, in fp32, against compressed-tensors' own fp32 decompression
    from qconv.engine.loader import our_int_weights, read_safetensors

    fp32 = load_model(tiny_artifact, pack=False)
    for name, iw in our_int_weights(tiny_artifact, read_safetensors(tiny_artifact), fp32.config).items():
        w = (iw.q.view(iw.q.shape[0], -1, iw.group).float() * iw.scale.float()[..., None]).view(iw.q.shape)
        assert torch.equal(w, fp32.get_submodule(name).weight), name


def test_zero_points_run_int4_within_bf16_rounding(zero_point_artifact):
    """Zero points reach the int4 kernel as its per-group zero (-zp * scale in bf16): the integers, scales and zero
    points equal compressed-tensors' fp32 decompression exactly, and the kernel's weights (applied to the identity)
    differ from it by at most the bf16 rounding of that zero, which is under the dense bf16 path's own rounding."""
    from qconv.engine.loader import our_int_weights, read_safetensors

    ints = load_model(zero_point_artifact, dtype=torch.bfloat16)
    fp32 = load_model(zero_point_artifact, pack=False)
    swapped = {n: m for n, m in ints.named_modules() if isinstance(m, Int4Linear)}
    assert len(swapped) == 4 * ints.config.num_layers
    found = our_int_weights(zero_point_artifact, read_safetensors(zero_point_artifact), fp32.config)
    assert {n for n, w in found.items() if w.zero is not None} == set(swapped)
    for name, m in swapped.items():
        iw, w = found[name], fp32.get_submodule(name).weight
        per_group = (iw.q.view(iw.q.shape[0], -1, iw.group) - iw.zero[..., None]).float() * iw.scale.float()[..., None]
        assert torch.equal(per_group.view(iw.q.shape), w), name
        kernel = m.int4_mm(torch.eye(m.in_features, dtype=torch.bfloat16)).t().float()
        bound = (iw.zero.float() * iw.scale.float()).abs().repeat_interleave(iw.group, 1) / 256
        assert ((kernel - w).abs() <= bound + (w.abs() / 256)).all(), name  # a dropped zero is off by |zp * s|


@pytest.mark.parametrize("artifact", ["tiny_artifact", "tiny35_artifact", "zero_point_artifact"])
def test_int_kernel_logits_match_dequantized(artifact, request):
    """bf16 logits, prefill + decode, vs the fp32 dequantized model: the int path's error stays within twice the
    dense bf16 path's error measured in the same run. Both paths use the same (exact) weights, so what separates
    them from fp32 is bf16 activation rounding; the int kernel accumulates in fp32 with unrounded q*scale weights,
    so it is not expected to be worse -- 2x leaves room for a different summation order, while a wrong scale,
    zero point, group or packing would be off by the size of the logits."""
    path = request.getfixturevalue(artifact)
    ref = load_model(path)  # fp32, dequantized
    ints = load_model(path, dtype=torch.bfloat16)
    deq = load_model(path, dtype=torch.bfloat16, int_kernels=False)
    assert _int4_modules(ints)
    toks = _tokens(ref.config.vocab_size, 24)
    caches = [m.new_cache(1, 40) for m in (ref, ints, deq)]
    errs = {"int": [], "deq": []}
    same = True
    steps = [toks[:, :16]] + [toks[:, i : i + 1] for i in range(16, 20)] + [toks[:, 20:22], toks[:, 22:24]]
    for step in steps:  # prefill (dense), decode steps of 1 and 2 rows (int4)
        r, a, b = (m(step, c) for m, c in zip((ref, ints, deq), caches))
        errs["int"].append((a - r).abs().max().item())
        errs["deq"].append((b - r).abs().max().item())
        same = same and torch.equal(a, b)
    scale = ref(toks[:, :4], ref.new_cache(1, 4)).abs().max().item()
    for e_int, e_deq in zip(errs["int"], errs["deq"]):
        assert e_int <= 2 * e_deq + 1e-3 * scale, errs
    assert not same  # the decode steps really ran a different kernel


def test_int4_supported_shapes():
    """Shapes/scales the int4 layout cannot hold exactly stay dense (the loader then keeps the dense Linear)."""

    def w(n, k, group, scale_dtype=torch.bfloat16, bits=4):
        return IntWeight(bits, torch.zeros(n, k, dtype=torch.int8), torch.full((n, k // group), 0.1).to(scale_dtype))

    assert int4_supported(w(32, 128, 64), 128)
    assert not int4_supported(w(8, 128, 64), 128)  # kernel layout needs N % 16 == 0
    assert not int4_supported(w(32, 96, 96), 96)  # group size the kernel is not used with
    assert not int4_supported(w(32, 128, 64, torch.float32), 128)  # 0.1 in fp32 is not a bf16 value
    assert not int4_supported(w(32, 128, 64, bits=8), 128)


def test_int_kernels_flag_and_dtype(tiny_artifact, tiny_qwen3):
    assert _int4_modules(load_model(tiny_artifact, dtype=torch.bfloat16))
    assert not _int4_modules(load_model(tiny_artifact, dtype=torch.bfloat16, int_kernels=False))
    assert not _int4_modules(load_model(tiny_artifact))  # fp32: the int kernels want bf16 activations
    assert not _int4_modules(load_model(tiny_qwen3, dtype=torch.bfloat16))  # plain folder: nothing to run as int
    with pytest.raises(QconvError, match="bfloat16"):
        load_model(tiny_artifact, int_kernels=True)


def test_cli_dequantize_option(tiny_artifact, tiny_qwen3, monkeypatch):
    """`qconv generate ARTIFACT` runs bf16 through the int kernels where the CPU computes bf16 natively (float32
    dequantized elsewhere); `--dequantize` the float32 dequantized path; the
    speculative benchmark (bench/spec_workloads.py) picks its dtype the same way."""
    from click.testing import CliRunner

    import qconv.engine.loader as loader
    from qconv.engine.commands import generate
    from qconv.engine.generate import GenerationConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from spec_workloads import run_bench

    monkeypatch.setattr(loader, "bf16_native", lambda: False)  # an AVX2-only CPU: bf16 emulated, float32 is faster
    assert loader.engine_dtype(tiny_artifact) == torch.float32
    monkeypatch.setattr(loader, "bf16_native", lambda: True)  # AVX-512 / AMX (the int kernels run either way)
    assert loader.engine_dtype(tiny_artifact) == torch.bfloat16
    assert loader.engine_dtype(tiny_artifact, dequantize=True) == torch.float32
    assert loader.engine_dtype(tiny_qwen3) == torch.float32  # plain folders keep the float32 default
    loaded = []
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    for flags in ([], ["--dequantize"]):
        r = CliRunner().invoke(generate, [str(tiny_artifact), "--prompt", "def add", "--max-tokens", "4", *flags])
        assert r.exit_code == 0, r.output
    data = tiny_artifact.parent / "chat.jsonl"
    data.write_text('{"turns": ["Say hello."]}\n')
    for deq in (False, True):
        rep, _, _ = run_bench(
            tiny_artifact, "chat", data, prompts=1, cfg=GenerationConfig(max_tokens=4), dequantize=deq
        )
        assert rep["dtype"] == ("float32" if deq else "bfloat16")
    assert [m.dtype for m in loaded] == [torch.bfloat16, torch.float32] * 2
    assert [bool(_int4_modules(m)) for m in loaded] == [True, False] * 2


@pytest.mark.slow
def test_smollm2_int_kernels_decode(smollm2, tmp_path, monkeypatch):
    """SmolLM2-135M in the 3090 layout (RTN): greedy decode runs its Linears through the int4 kernel and stays on
    the dequantized path's tokens for most of 24 steps (bf16: a near-tie may flip later). Speed is
    bench/decode_speed.py's (BENCHMARKS), not a unit test's."""
    art = _quantize(smollm2, tmp_path / "smol", SMOLLM2_LAYOUT)
    ints = load_model(art, dtype=torch.bfloat16)
    deq = load_model(art, dtype=torch.bfloat16, int_kernels=False)
    assert len(_int4_modules(ints)) == 4 * ints.config.num_layers
    calls, real = [], Int4Linear.int4_mm
    monkeypatch.setattr(Int4Linear, "int4_mm", lambda self, x: calls.append(1) or real(self, x))
    prompt = _tokens(ints.config.vocab_size, 12)
    outs = {}
    for name, m in (("int", ints), ("deq", deq)):
        cache, tok, out = m.new_cache(1, 40), prompt, []
        for _ in range(24):
            tok = m(tok, cache)[:, -1:].argmax(-1)
            out.append(int(tok))
        outs[name] = out
    assert len(calls) == 23 * 4 * ints.config.num_layers  # every decode step, none in the 12-token prefill
    agree = next((i for i, (x, y) in enumerate(zip(outs["int"], outs["deq"])) if x != y), 24)
    assert agree >= 12, outs


def test_serve_native_runs_as_generate_does(tiny_artifact, monkeypatch, log_records):
    """Issue 30, point 3: `qconv serve --backend native` loads an artifact as `qconv generate` does (bf16, its int4
    Linears and int8 embedding through the CPU int kernels) and says so in its startup line."""

    import uvicorn
    from click.testing import CliRunner

    import qconv.engine.loader as loader
    from qconv.cli import main
    from qconv.serve.scheduler import Scheduler

    monkeypatch.setattr(loader, "bf16_native", lambda: True)  # as on a CPU with native bf16 (see above)
    served = []
    monkeypatch.setattr(Scheduler, "start", lambda self: served.append(self) or self)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: None)
    records = log_records("qconv.serve.native")
    r = CliRunner().invoke(main, ["serve", str(tiny_artifact), "--backend", "native"])
    assert r.exit_code == 0, r.output
    (sched,) = served
    model = sched.model
    assert model.norm.weight.dtype == torch.bfloat16
    n4 = len(_int4_modules(model))
    assert n4 == 4 * model.config.num_layers and isinstance(model.embed_tokens, Int8Embedding)
    line = next(rec.getMessage() for rec in records if rec.getMessage().startswith("native engine on "))
    assert f"bfloat16, int4 kernels on {n4} Linears + int8 embedding lookup" in line

    # --compute-dtype float32: the same engine, dequantized to float32 on load, on the same CPU
    r = CliRunner().invoke(main, ["serve", str(tiny_artifact), "--backend", "native", "--compute-dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert served[-1].model.norm.weight.dtype == torch.float32 and not _int4_modules(served[-1].model)
