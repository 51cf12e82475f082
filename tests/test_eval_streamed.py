"""Issue 16, item 1: the layer-streamed forward gives the numbers of the whole-model path (same windows, same
reference cache), for llama, qwen3 and the qwen3_5 hybrid, for the bf16 source and the compressed artifact; the CLI
picks it when the model does not fit in free memory or when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from qconv.eval.measure import Source, measure, safetensors_stats
from qconv.eval.record import EvalReport, EvalSettings, ForwardInfo
from tests.cli_helpers import CPU_COMPUTE, SMALL_CAL, build, run
from tests.tiny import CORPUS, TINY_FAMILIES

STATS = ("kld_mean", "kld_p99", "top1", "ppl_ratio")


@pytest.fixture(scope="module")
def built(tiny_models, tmp_path_factory):
    """Factory: the 3090 build of a tiny model (W4 GPTQ layers, INT8 embed_tokens/lm_head), no quality stage."""
    made = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            src = tiny_models(family)
            root = tmp_path_factory.mktemp(f"built_{family}")
            cal = root / "cal.txt"
            cal.write_text(CORPUS * 20)
            out = root / "art"
            r = build("3090", src, out, "--dataset", cal, *SMALL_CAL, "--work-dir", root / "work")
            assert r.exit_code == 0, r.output
            made[family] = (src, out)
        return made[family]

    return get


def _measure(
    art: Path, src: Path, text: Path, streamed: bool, home: Path, monkeypatch, kv=None, window=64, max_tokens=512
) -> EvalReport:
    from qconv.eval.forward import Forward

    monkeypatch.setenv("QCONV_HOME", str(home))  # each path computes its own reference
    source = Source(path=src, sha256="test-" + src.name, num_parameters=safetensors_stats(src)[0])
    report, _ = measure(
        art,
        source,
        EvalSettings(text=str(text), window=window, max_tokens=max_tokens, kv=kv, stride=window // 2),
        Forward(streamed=streamed, device="cpu"),
    )
    assert report.forward == ForwardInfo(streamed=streamed, device="cpu", compute_dtype=CPU_COMPUTE)
    return report


def assert_same(a: EvalReport, b: EvalReport, sections=("weights",), tol=1e-4) -> None:
    for sec in sections:
        x, y = getattr(a, sec), getattr(b, sec)
        for k in STATS:
            assert abs(getattr(x, k) - getattr(y, k)) <= tol, (sec, k, getattr(x, k), getattr(y, k))
        assert x.tokens == y.tokens


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_streamed_equals_whole_model(family, built, text_file, tmp_path, monkeypatch):
    """`qconv eval` of each family's 3090 build, whole and streamed layer by layer."""
    src, art = built(family)
    # KV simulation inside the streamed attention layers too (gemma3: sliding-window ones among them)
    kv = "fp8_e4m3" if family in ("qwen3_5", "gemma3") else None
    whole = _measure(art, src, text_file, False, tmp_path / "whole", monkeypatch, kv=kv)
    streamed = _measure(art, src, text_file, True, tmp_path / "streamed", monkeypatch, kv=kv)
    assert whole.weights.kld_mean > 0  # a real quantization cost is being compared
    assert_same(whole, streamed, ("weights", "weights_kv") if kv else ("weights",))


def test_streamed_reference_equals_whole_reference(built, text_file, tmp_path, monkeypatch):
    """The reference windows themselves (top-k storage forced, so the tail bound is exercised) agree."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from qconv.eval.forward import Forward, LogitSource
    from qconv.eval.reference import build_reference
    from qconv.eval.text import load_text, make_windows

    src, _ = built("qwen3_5")
    text = load_text(text_file)
    windows = make_windows(AutoTokenizer.from_pretrained(src), text, window=64, max_tokens=256)
    refs = []
    for streamed in (False, True):
        monkeypatch.setenv("QCONV_HOME", str(tmp_path / str(streamed)))
        ref = build_reference(
            src,
            windows,
            source_sha256="s",
            text_sha256=text.sha256,
            topk=32,
            logit_source=LogitSource(src, Forward(streamed=streamed, device="cpu"), 0, "ref"),
        )
        refs.append([load_file(p) for p in sorted(ref.folder.glob("window_*.safetensors"))])
    assert len(refs[0]) == len(windows.ids) == len(refs[1])
    for a, b in zip(*refs):
        assert (a["topk_idx"] == b["topk_idx"]).all()
        for k in ("topk_logp", "entropy", "target_logp"):
            assert (a[k] - b[k]).abs().max() <= 1e-4, k


def test_cli_streams_when_the_model_does_not_fit(built, text_file, tmp_path, monkeypatch):
    import qconv.eval.forward as forward

    src, art = built("llama")
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(forward, "free_bytes", lambda device: 1 << 10)  # 1 KiB free: nothing fits
    args = ["eval", art, "--reference", src, "--text", text_file, "--window", "64", "--max-tokens", "256"]
    r = run(*args, "--out", tmp_path / "auto")
    assert r.exit_code == 0, r.output
    auto = EvalReport.read(tmp_path / "auto" / "report.json")
    assert auto.forward is not None and auto.forward.streamed is True
    r = run(*args, "--whole-model", "--out", tmp_path / "whole")
    assert r.exit_code == 0, r.output
    whole = EvalReport.read(tmp_path / "whole" / "report.json")
    assert whole.forward is not None and whole.forward.streamed is False
    assert_same(auto, whole)
    monkeypatch.undo()
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))
    r = run(
        "check",
        art,
        "--reference",
        src,
        "--text",
        text_file,
        "--window",
        "64",
        "--max-tokens",
        "256",
        "--streamed",
        "--recipe",
        "3090",
        "--out",
        tmp_path / "check",
    )
    checked = EvalReport.read(tmp_path / "check" / "report.json").forward
    assert checked is not None and checked.streamed is True


def test_bad_device_is_one_clear_error(built, text_file):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    src, art = built("llama")
    r = run("eval", art, "--reference", src, "--text", text_file, "--window", "64", "--device", "cuda")
    assert r.exit_code == 2 and "--device" in r.output and "no CUDA device" in r.output, r.output


@pytest.mark.slow
def test_smollm2_3090_streamed_equals_whole(smollm2_3090, smollm2, shared_data, tmp_path, monkeypatch):
    """SmolLM2's 3090 artifact (one shared INT8 table for the tied embed/lm_head) on wikitext: KLD mean / p99 / top-1 to
    1e-4, over three overlapping windows of 1,024 tokens."""
    text = shared_data / "wikitext-2-raw-test.txt"
    whole = _measure(smollm2_3090, smollm2, text, False, tmp_path / "w", monkeypatch, window=1024, max_tokens=2048)
    streamed = _measure(smollm2_3090, smollm2, text, True, tmp_path / "s", monkeypatch, window=1024, max_tokens=2048)
    print(
        "SmolLM2 3090 whole vs streamed:", {k: (getattr(whole.weights, k), getattr(streamed.weights, k)) for k in STATS}
    )
    assert_same(whole, streamed)


def test_large_matrices_dequantize_in_row_blocks_to_the_same_bits(built, monkeypatch):
    """A big INT8 lm_head / W4 projection is dequantized a block of rows at a time (bounded temporaries); the
    result equals the whole-matrix dequantization bit for bit."""
    import torch

    import qconv.convert.dequant as dequant
    import qconv.eval.layerwise as layerwise

    _, art = built("qwen3_5")
    ckpt = layerwise.Checkpoint.open(art)
    prefixes = ["lm_head.", "model.embed_tokens.", "model.layers.0.", "model.layers.1."]
    whole = {p: ckpt.read(p) for p in prefixes}
    monkeypatch.setattr(dequant, "BLOCK_ROWS", 48)  # several blocks for every matrix here
    for p in prefixes:
        got = ckpt.read(p)
        assert set(got) == set(whole[p]) and any(t.dim() == 2 and t.shape[0] > 48 for t in got.values())
        for k, t in whole[p].items():
            assert t.dtype == got[k].dtype and torch.equal(t, got[k]), (p, k)


def test_one_dequantizer_equals_compressed_tensors_own(built):
    """qconv.convert.dequant (the runtime's and the streamed eval's one dequantizer) gives compressed-tensors'
    model-free dequantizer's bits for every module of an artifact with W4, INT8 and a quantized embedding (as
    stored: before it folds the recipe's input rotations, tests/test_rotation.py)."""
    import torch
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    from qconv.convert.dequant import _dequantized
    from qconv.modelfiles import read_model_config

    _, art = built("qwen3_5")
    raw = {}
    for f in sorted(art.glob("*.safetensors")):
        raw.update(load_file(f))
    ours = _dequantized(read_model_config(art)["quantization_config"], dict(raw), torch.bfloat16, str(art), None)
    theirs = CompressedTensorsDequantizer(str(art), dtype=torch.bfloat16).process(dict(raw))
    assert any(k.endswith("weight_packed") for k in raw) and set(ours) == set(theirs)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k
