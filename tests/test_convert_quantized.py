"""Already-quantized checkpoints: lossless import (`qconv convert quantized`) and `qconv build` on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from filelock import FileLock

from qconv.convert.quantized import detect_format
from qconv.errors import QconvError
from tests.cli_helpers import build_args
from tests.conftest import CACHE, REPO
from tests.quantized_sources import GROUP, SOURCES, reference_dense

TESTED_IN = {"qwen3": list(SOURCES), "qwen3_5": ["gptq-sym"]}  # the formats each tiny family is made in here


def _quantized(base: Path, family: str, name: str) -> Path:
    """A tiny checkpoint quantized by auto-round itself, cached by source, family and format. The first call for a
    family makes every format of it still missing (TESTED_IN) in one subprocess (auto-round sets process-wide
    state; its import takes seconds, paid once instead of once a format)."""
    root = CACHE / "quantized"
    root.mkdir(parents=True, exist_ok=True)

    def made(n: str) -> bool:
        return any((root / f"{family}-{n}").rglob("config.json"))

    with FileLock(f"{root / family}.lock"):  # the suite's parallel workers share the cache
        if not made(name):
            missing = [n for n in TESTED_IN[family] if not made(n)]
            subprocess.run(
                [sys.executable, "-m", "tests.quantized_sources", str(base), str(root), family, *missing],
                check=True,
                cwd=REPO,
                capture_output=True,
            )
    return next((root / f"{family}-{name}").rglob("config.json")).parent


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _ct_dense(folder: Path, mod: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of one module, in the stored scale dtype."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = [s for s in cfg.config_groups.values() if mod in s.targets]
    comp = BaseCompressor.get_value_from_registry("pack-quantized")
    local = {p: tensors[f"{mod}.{p}"] for p in comp.compression_param_names(scheme) if f"{mod}.{p}" in tensors}
    return comp.decompress(local, scheme)["weight"]


def _assert_lossless(src: Path, out: Path) -> int:
    """Every quantized module of `src` dequantizes bit for bit the same from `out`; returns how many."""
    fmt = detect_format(json.loads((src / "config.json").read_text()))
    st, ct = _tensors(src), _tensors(out)
    mods = sorted(k[: -len(".qweight")] for k in st if k.endswith(".qweight"))
    assert mods
    for mod in mods:
        ref = reference_dense(st.get, mod, fmt.layout, fmt.zero_offset, 4, GROUP)
        got = _ct_dense(out, mod, ct)
        assert got.dtype == ref.dtype == torch.float16
        assert torch.equal(got.view(torch.int16), ref.contiguous().view(torch.int16)), mod
        assert (f"{mod}.weight_zero_point" in ct) == (not fmt.sym), mod
    return len(mods)


def _generate(path: Path, dtype=torch.float32, n: int = 8) -> list[int]:
    from qconv.engine import load_model
    from qconv.engine.generate import GenerationConfig, generate_tokens

    model = load_model(path, dtype=dtype)
    return list(generate_tokens(model, [5, 17, 42, 9], GenerationConfig(max_tokens=n)))


def test_detect_format():
    f = detect_format({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}})
    assert (f.layout, f.zero_offset) == ("gptq", 1)
    f = detect_format({"quantization_config": {"quant_method": "gptq", "checkpoint_format": "gptq_v2", "bits": 4}})
    assert f.zero_offset == 0
    f = detect_format({"quantization_config": {"quant_method": "auto-round", "packing_format": "auto_round:auto_awq"}})
    assert f.layout == "awq"
    assert detect_format({"quantization_config": {"quant_method": "compressed-tensors"}}).layout == "compressed-tensors"
    assert detect_format({"model_type": "qwen3"}) is None
    for bad in (
        {"quant_method": "awq", "version": "gemv"},
        {"quant_method": "fp8"},
        {"quant_method": "gptq", "bits": 3},
        {"quant_method": "auto-round", "data_type": "nv_fp"},
    ):
        with pytest.raises(QconvError):
            detect_format({"quantization_config": bad})


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_import_lossless_and_runs(tiny_qwen3, tmp_path, name):
    """Per format: auto-round quantizes a tiny qwen3, we convert it; every module's dequantized weights equal the
    format's own reference dequantization bit for bit; the artifact generates in our engine."""
    from qconv.cli import main
    from qconv.manifest import read_manifest

    src = _quantized(tiny_qwen3, "qwen3", name)
    out = tmp_path / "ct"
    r = CliRunner().invoke(main, ["convert", "quantized", str(src), str(out)])
    assert r.exit_code == 0, r.output
    assert _assert_lossless(src, out) == 14
    m = read_manifest(out)
    assert (
        m.source.quantization["method"]
        == json.loads((src / "config.json").read_text())["quantization_config"]["quant_method"]
    )
    assert len(m.build.kept) == 14 and not m.build.requantized
    assert len(_generate(out)) == 8
    if SOURCES[name][1]:
        assert len(_generate(out, torch.bfloat16)) == 8  # symmetric int4: the CPU int4 kernel path


def test_act_order(tiny_qwen3, tmp_path):
    """GPTQ desc_act: auto-round cannot export act-order, so the checkpoint is written by hand in the AutoGPTQ
    layout, its g_idx as GPTQModel's GPTQ.quantize writes it (static groups: the plain group map; otherwise
    invperm // group_size, a random permutation here). Static groups import losslessly; a permuted g_idx has no
    form compressed-tensors 0.19 or vLLM 0.32 reads, and `convert quantized` and `build` both refuse it before
    writing anything."""
    import shutil

    from safetensors.torch import save_file

    from qconv.cli import main
    from qconv.convert.imported import convert_quantized

    base = _quantized(tiny_qwen3, "qwen3", "gptq-asym")
    for case in ("static", "permuted"):
        src = tmp_path / case
        shutil.copytree(base, src)
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"].update(desc_act=True, static_groups=case == "static")
        (src / "config.json").write_text(json.dumps(cfg))
        st = _tensors(src)
        g = torch.Generator().manual_seed(0)
        for k in [k for k in st if k.endswith(".g_idx")]:
            if case == "permuted":
                st[k] = st[k][torch.randperm(st[k].numel(), generator=g)].contiguous()
            assert st[k].numel() > GROUP
        for f in src.glob("*.safetensors"):
            f.unlink()
        save_file(st, src / "model.safetensors", metadata={"format": "pt"})
        if case == "static":
            convert_quantized(str(src), tmp_path / "out-static")
            assert _assert_lossless(src, tmp_path / "out-static") == 14
            continue
        for args in (
            ["convert", "quantized", str(src), str(tmp_path / "out-permuted")],
            build_args("3090", src, tmp_path / "out-permuted"),
        ):
            r = CliRunner().invoke(main, args)
            assert r.exit_code != 0 and "g_idx" in r.output and "13 more modules" in r.output, r.output
            assert "desc_act=False or static_groups=True" in r.output, r.output
            assert not (tmp_path / "out-permuted").exists()


def test_compressed_tensors_passthrough(tiny_qwen3, tmp_path):
    """A compressed-tensors source goes through byte for byte (llmcompressor-made, int4 g32 MLPs)."""
    from qconv.convert.imported import convert_quantized
    from tests.test_engine_model import _quantize

    src = _quantize(tiny_qwen3, tmp_path / "llmc", {"w4": (["re:.*mlp.*"], 4, 32)})
    convert_quantized(str(src), tmp_path / "out")
    a, b = _tensors(src), _tensors(tmp_path / "out")
    assert a.keys() == b.keys()
    assert all(
        torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k])
        and a[k].dtype == b[k].dtype
        for k in a
    )
    assert len(_generate(tmp_path / "out")) == 8


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_vllm_parses_import(tiny_qwen3, tmp_path, name, vllm_python):
    """vLLM's own compressed-tensors parser accepts every imported config (symmetric and zero-point WNA16)."""
    from qconv.convert.imported import convert_quantized
    from qconv.serve.vllm import load_source
    from qconv.serve.vllm_probe import check_quant_config

    out = tmp_path / "ct"
    convert_quantized(str(_quantized(tiny_qwen3, "qwen3", name)), out)
    check_quant_config(load_source(out, recipe="3090"), vllm_python, "0.32")


def _bytes_of(tensors: dict[str, torch.Tensor], names) -> dict[str, bytes]:
    return {k: tensors[k].contiguous().view(torch.uint8).numpy().tobytes() for k in names}


@pytest.mark.slow
def test_build_from_gptq_qwen3_5(tiny_qwen3_5, tmp_path, shared_data):
    """`qconv build --recipe 3090` on a tiny W4A16 GPTQ qwen3_5 with its MTP head: every int4 tensor is the lossless
    import's, byte for byte; embed/lm_head become INT8 pack-quantized; mtp.* are copied unchanged; peak RSS of
    the build process is measured; the result runs in our engine; the report says what it compared against."""
    from qconv.convert.imported import convert_quantized
    from qconv.manifest import read_manifest

    src = _quantized(tiny_qwen3_5, "qwen3_5", "gptq-sym")
    assert any(k.startswith("mtp.") for k in _tensors(src))
    text = tmp_path / "eval.txt"
    text.write_text(
        (shared_data / "tinyshakespeare.txt").read_text()[:6000]
        if (shared_data / "tinyshakespeare.txt").is_file()
        else (REPO / "README.md").read_text()[:6000]
    )
    out = tmp_path / "art"
    # VmHWM is this process's own peak: ru_maxrss would carry over pytest's RSS, which a forked child inherits
    # into its high-water mark across exec
    code = (
        "import sys; from qconv.cli import main\n"
        "try:\n    main(sys.argv[1:], standalone_mode=False)\n"
        "finally:\n    print('MAXRSS', [ln.split()[1] for ln in open('/proc/self/status') "
        "if ln.startswith('VmHWM')][0])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *build_args("3090", src, out), "--eval-text", str(text), "--no-gates"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rss_mb = int(r.stdout.split("MAXRSS")[-1].split()[0]) / 1024
    print(f"peak RSS of the build process: {rss_mb:.0f} MB")
    assert rss_mb < 2048  # the torch/transformers import baseline plus one shard; the tiny model is 2 MB

    convert_quantized(str(src), tmp_path / "plain")
    plain, built, source = _tensors(tmp_path / "plain"), _tensors(out), _tensors(src)
    int4 = [
        k for k in plain if k.rpartition(".")[0] in {n[: -len(".qweight")] for n in source if n.endswith(".qweight")}
    ]
    assert int4 and _bytes_of(built, int4) == _bytes_of(plain, int4)
    mtp = [k for k in source if k.startswith("mtp.")]
    assert _bytes_of(built, mtp) == _bytes_of(source, mtp)
    for mod in ("model.embed_tokens", "lm_head"):
        assert built[f"{mod}.weight_packed"].dtype == torch.int32 and f"{mod}.weight" not in built
        w = _ct_dense(out, mod, built).float()
        step = built[f"{mod}.weight_scale"].float().max()  # one int8 step
        assert (w - source[f"{mod}.weight"].float()).abs().max() <= step
    m = read_manifest(out)
    assert sorted(m.build.requantized) == ["lm_head", "model.embed_tokens"]
    assert set(m.build.kept) == {n[: -len(".qweight")] for n in source if n.endswith(".qweight")}
    assert m.source.quantization["method"] == "gptq"
    assert m.build.quality_reference["kind"] == "source checkpoint"
    report = json.loads((out / "report.json").read_text())
    assert "started from" in report["reference_model"]["note"]
    assert len(_generate(out)) == 8 and len(_generate(out, torch.bfloat16)) == 8

    ref_out = tmp_path / "art-ref"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "qconv.cli",
            *build_args("3090", src, ref_out),
            "--eval-text",
            str(text),
            "--no-gates",
            "--reference",
            str(tiny_qwen3_5),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((ref_out / "report.json").read_text())["reference_model"]["kind"] == "original"
    assert read_manifest(ref_out).build.quality_reference["kind"] == "original"


@pytest.mark.slow
def test_build_against_cached_reference(tiny_qwen3, tmp_path, shared_data):
    """`qconv build --model <quantized> --reference <cache>`: the reference log-probs a bf16 run cached stand in for
    the bf16 model (same numbers, the report says so); a cache made on another text is refused, nothing written."""
    import shutil

    from qconv.cli import main
    from qconv.manifest import read_manifest

    src = _quantized(tiny_qwen3, "qwen3", "gptq-sym")
    text = tmp_path / "eval.txt"
    text.write_text((shared_data / "tinyshakespeare.txt").read_text()[:6000])
    common = ["build", "--recipe", "3090", "--model", str(src), "--eval-text", str(text), "--no-gates"]
    r = CliRunner().invoke(main, common + ["--out", str(tmp_path / "a"), "--reference", str(tiny_qwen3)])
    assert r.exit_code == 0, r.output
    first = json.loads((tmp_path / "a" / "report.json").read_text())
    cache = tmp_path / "cache"
    shutil.copytree(first["reference"]["cache"], cache)

    r = CliRunner().invoke(main, common + ["--out", str(tmp_path / "b"), "--reference", str(cache)])
    assert r.exit_code == 0, r.output
    got = json.loads((tmp_path / "b" / "report.json").read_text())
    assert got["weights"] == first["weights"] and got["source"]["sha256"] == first["source"]["sha256"]
    assert got["reference_model"]["kind"] == "original" and got["reference_model"]["cached"]
    assert (
        got["reference_model"]["path"] == str(cache) and "cached reference log-probs" in got["reference_model"]["note"]
    )
    q = read_manifest(tmp_path / "b").build.quality_reference
    assert q["kind"] == "original" and q["cached"]
    assert (tmp_path / "b" / "report.md").read_text().startswith("Reference: against cached reference log-probs")

    text.write_text((shared_data / "tinyshakespeare.txt").read_text()[6000:12000])
    r = CliRunner().invoke(main, common + ["--out", str(tmp_path / "c"), "--reference", str(cache)])
    assert r.exit_code == 2 and "text_sha256" in r.output, r.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_build_from_quantized_records_true_requires(tiny_models, tmp_path, family):
    """Issue 30, point 4: `requires` of a build from a quantized checkpoint comes from the source's own config: the
    tied llama's INT8 table is also its head (the plugin's tied-head feature recorded), and stock vLLM's qwen3 model
    loads a quantized embed_tokens itself (no embedding entry)."""
    from qconv.manifest import QUANTIZED_EMBEDDINGS, TIED_QUANTIZED_HEAD, read_manifest
    from tests.test_engine_model import _quantize

    src = _quantize(tiny_models(family), tmp_path / "llmc", {"w4": (["re:.*mlp.*"], 4, 32)})
    out = tmp_path / "art"
    r = CliRunner().invoke(
        __import__("qconv.cli", fromlist=["main"]).main,
        [*build_args("3090", src, out), "--no-gates"],
    )
    assert r.exit_code == 0, r.output
    m = read_manifest(out)
    assert "model.embed_tokens" in m.build.requantized
    features = {q.vllm_feature for q in m.requires}
    if family == "llama":
        assert {QUANTIZED_EMBEDDINGS, TIED_QUANTIZED_HEAD} <= features
    else:
        assert QUANTIZED_EMBEDDINGS not in features and TIED_QUANTIZED_HEAD not in features
