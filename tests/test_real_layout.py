"""Issue 16, item 5: a tiny checkpoint laid out like the published 27B (Qwen3_5ForConditionalGeneration: text under
model.language_model.*, a vision tower under model.visual.*, mtp.* tensors transformers does not load, sharded with an
index) through `qconv build --recipe 3090`, transformers, our engine and `qconv eval` (streamed == whole model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qconv.manifest import read_manifest, verify_files
from tests.cli_helpers import SMALL_CAL, build, run
from tests.tiny import CORPUS


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def artifact(real_layout_27b, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real3090")
    (root / "cal.txt").write_text(CORPUS * 20)
    out = root / "art"
    r = build("3090", real_layout_27b, out, "--dataset", root / "cal.txt", *SMALL_CAL, "--work-dir", root / "work")
    assert r.exit_code == 0, r.output
    return out


def test_fixture_is_laid_out_like_the_27b(real_layout_27b, config_27b):
    real = json.loads((config_27b / "config.json").read_text())
    tiny = json.loads((real_layout_27b / "config.json").read_text())
    assert tiny["architectures"] == real["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    for part in ("text_config", "vision_config"):
        assert set(real[part]) <= set(tiny[part]), part
    tc = tiny["text_config"]
    assert tc["hidden_size"] < real["text_config"]["hidden_size"]
    assert tc["layer_types"] == real["text_config"]["layer_types"][: tc["num_hidden_layers"]]
    index = json.loads((real_layout_27b / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3
    assert any(k.startswith("model.language_model.layers.") for k in index)
    assert any(k.startswith("model.visual.blocks.") for k in index)
    assert any(k.startswith("mtp.layers.0.") for k in index)


def test_build_keeps_vision_and_mtp_bytes_and_quantizes_text(real_layout_27b, artifact):
    src, art = _tensors(real_layout_27b), _tensors(artifact)
    kept = [k for k in src if k.startswith(("model.visual.", "mtp."))]
    assert kept and all(k in art for k in kept)
    for k in kept:  # byte-identical: same dtype, same shape, same bits
        assert art[k].dtype == src[k].dtype and torch.equal(art[k].view(torch.uint8), src[k].view(torch.uint8)), k
    qcfg = json.loads((artifact / "config.json").read_text())["quantization_config"]
    ignore = qcfg["ignore"]
    vision_linears = {
        k.rsplit(".", 1)[0] for k in src if k.startswith("model.visual.") and src[k].dim() == 2 and "pos_embed" not in k
    }
    assert vision_linears <= set(ignore)
    assert "re:^mtp.*" in ignore or any(i.startswith("mtp") for i in ignore)
    m = read_manifest(artifact)
    assert verify_files(artifact, m) == []
    by = {d.name: d for d in m.modules}
    text = {n: d for n, d in by.items() if n.startswith("model.language_model.layers.")}
    for name, d in text.items():  # as the manifest decided: W4 (or INT8 where the auto budget promoted it)
        if d.bits in (4, 8):
            assert name + ".weight_packed" in art and name + ".weight" not in art, name
        else:
            assert art[name + ".weight"].dtype == torch.bfloat16, name
    quantized = {d.role for d in text.values() if d.bits in (4, 8)}
    assert {"attn_qkv", "attn_o", "gdn_qkvz", "gdn_out", "mlp_gate_up", "mlp_down"} <= quantized
    # a tiny model plans far above selection.max_bpw (its INT8 embeddings alone), so the card promotes nothing
    assert m.selection.budget == "auto" and m.selection.budget_bytes == 0
    for name in ("model.language_model.embed_tokens", "lm_head"):  # INT8, pack-quantized (vLLM's WNA16 form)
        assert name + ".weight_packed" in art and by[name].bits == 8, name
    assert art["model.language_model.layers.0.linear_attn.in_proj_a.weight"].dtype == torch.bfloat16


def test_artifact_loads_in_transformers_and_our_engine(artifact):
    from qconv.convert.hfmodel import load_causal_lm
    from qconv.engine import load_model

    hf = load_causal_lm(artifact, device="cpu")
    ours = load_model(artifact)
    toks = torch.randint(3, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = hf(toks.to(hf.device), use_cache=False).logits.float()
        b = ours(toks, ours.new_cache(1, 32)).float()
    assert a.shape == b.shape
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9  # bf16 (transformers) vs fp32 (ours)
    assert (a - b).abs().max() < 0.05 * a.abs().max() + 1e-3


def test_eval_measures_it_streamed_equals_whole(artifact, real_layout_27b, tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text(CORPUS * 3)
    reports = {}
    for flag in ("--streamed", "--whole-model"):
        monkeypatch.setenv("QCONV_HOME", str(tmp_path / flag))
        out = tmp_path / flag.strip("-")
        r = run(
            "eval",
            artifact,
            "--text",
            text,
            "--window",
            "64",
            "--max-tokens",
            "512",
            "--kv",
            "fp8_e4m3",
            flag,
            "--out",
            out,
        )
        assert r.exit_code == 0, r.output
        reports[flag] = json.loads((out / "report.json").read_text())
    s, w = reports["--streamed"], reports["--whole-model"]
    assert s["forward"]["streamed"] and not w["forward"]["streamed"]
    assert Path(s["source"]["path"]).resolve() == real_layout_27b.resolve()
    for sec in ("weights", "weights_kv"):
        assert s[sec]["kld_mean"] > 0
        for k in ("kld_mean", "kld_p99", "top1"):
            assert abs(s[sec][k] - w[sec][k]) <= 1e-4, (sec, k)


def test_streamed_sensitivity_reads_the_real_layout(real_layout_27b, tmp_path):
    """The layer-at-a-time proxy finds the units under model.language_model.* and scores them as the in-memory
    proxy does on the model transformers loads."""
    from qconv.build.streamed_sensitivity import streamed_proxy_scores
    from qconv.calibrate.sensitivity import proxy_scores
    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.layout import candidate_units, layout_model
    from qconv.convert.sources import read_config
    from qconv.recipes.recipe import load_recipe

    recipe = load_recipe("3090")
    units = candidate_units(layout_model(real_layout_27b, read_config(real_layout_27b), recipe), recipe)
    assert units and all(".language_model.layers." in m.name for u in units for m in u.base)
    ids = [list(range(5, 45)), list(range(50, 90))]
    want = proxy_scores(load_causal_lm(real_layout_27b).eval(), units, ids)
    got = streamed_proxy_scores(real_layout_27b, units, ids, tmp_path)
    for u in units:
        assert got.values[u.name] == pytest.approx(want.values[u.name], rel=2e-2, abs=1e-12), u.name
