"""`qconv eval` / `qconv check` end to end on a tiny RTN W4 artifact: reports written, a damaged artifact fails a
tight gate (exit 1, gate + measured value named) while the undamaged one passes, and bad inputs exit 2."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from qconv.cli import main

WINDOW = ["--window", "64", "--max-tokens", "512"]


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory) -> Path:
    from tests.eval_helpers import make_w4_artifact

    return make_w4_artifact(tiny_llama, tmp_path_factory.mktemp("art") / "tiny-rtn", algorithm="rtn")


def qconv(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def evaluated(artifact, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "r"
    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--kv", "fp8_e4m3", "--out", out)
    assert r.exit_code == 0, r.output
    return out, r.output


def test_eval_writes_reports(evaluated):
    out, output = evaluated
    rep = json.loads((out / "report.json").read_text())
    assert {"report.json", "report.md", "kld.png"} <= {p.name for p in out.iterdir()}
    assert (out / "kld.png").read_bytes()[:4] == b"\x89PNG"
    w, kv = rep["weights"], rep["weights_kv"]
    assert w["tokens"] == rep["text"]["tokens_scored"] > 400
    assert 0 < w["kld_mean"] and w["kld_median"] <= w["kld_p90"] <= w["kld_p99"] <= w["kld_p999"] <= w["kld_max"]
    assert kv["kld_mean"] != w["kld_mean"] and rep["kv_scheme"] == "fp8_e4m3"
    assert rep["reference"]["storage"] == "full" and rep["tier"]["name"].startswith("small")
    assert "outside this recipe's target class" in rep["tier"]["note"]
    assert "Mean    KLD" in output and "Same top p" in output and "| weights only |" in output


def _tight_recipe(path: Path, report: dict) -> Path:
    """The 3090 recipe with one tier whose gates sit 20% above what the undamaged artifact measured."""
    from qconv.recipes.recipe import load_recipe

    d = load_recipe("3090").to_dict()
    w = report["weights"]
    d["quality"]["tiers"] = [
        {
            "name": "tight test tier",
            "min_params": 0,
            "weights": {"max_mean_kld": 1.2 * w["kld_mean"], "min_top1": w["top1"] - 0.05},
            "weights_kv": {},
        }
    ]
    path.write_text(yaml.safe_dump(d))
    return path


def _damage(src: Path, dst: Path) -> str:
    """Copy the artifact, multiply one layer's weight_scale by 1.5, and re-record the file hashes (a bad build,
    not a corrupted download)."""
    from safetensors.torch import load_file, save_file

    from qconv.manifest import hash_artifact_files, read_manifest

    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    tensors = load_file(st)
    name = sorted(k for k in tensors if k.endswith("mlp.down_proj.weight_scale"))[0]
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, st, metadata={"format": "pt"})
    m = read_manifest(dst)
    m.files = hash_artifact_files(dst)
    m.write(dst)
    return name


def test_damaged_artifact_fails_check_undamaged_passes(artifact, evaluated, text_file, tmp_path):
    report = json.loads((evaluated[0] / "report.json").read_text())
    recipe = _tight_recipe(tmp_path / "tight.yaml", report)
    junit = tmp_path / "ok.xml"
    ok = qconv("check", artifact, "--text", text_file, *WINDOW, "--recipe", recipe, "--junit", junit)
    assert ok.exit_code == 0, ok.output
    assert "check passed" in ok.output
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "0"

    bad = tmp_path / "damaged"
    _damage(artifact, bad)
    junit = tmp_path / "bad.xml"
    r = qconv(
        "check",
        bad,
        "--text",
        text_file,
        *WINDOW,
        "--recipe",
        recipe,
        "--junit",
        junit,
        "--against",
        evaluated[0] / "report.json",
    )
    assert r.exit_code == 1, r.output
    assert "weights.max_mean_kld: measured" in r.output and "FAILED" in r.output
    assert "weights.kld_mean vs recorded" in r.output  # the regression against the undamaged report
    suite = ET.parse(junit).getroot().find("testsuite")
    assert int(suite.get("failures")) >= 2


def test_check_detects_files_not_matching_manifest(artifact, text_file, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(artifact, bad)
    (bad / "extra.bin").write_bytes(b"x")
    r = qconv("check", bad, "--text", text_file, *WINDOW)
    assert r.exit_code == 1 and "extra.bin: not in manifest" in r.output


def test_bad_inputs_exit_2(artifact, text_file, tmp_path, tiny_llama):
    short = tmp_path / "short.txt"
    short.write_text("hello there")
    r = qconv("eval", artifact, "--text", short, *WINDOW)
    assert r.exit_code == 2 and "shorter than one window" in r.output

    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--reference", tmp_path / "no-such-model")
    assert r.exit_code == 2 and "reference model not available" in r.output

    r = qconv("eval", tiny_llama, "--text", text_file, *WINDOW)
    assert r.exit_code == 2 and "no qconv.json" in r.output

    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--tasks", "gsm8k_local")
    assert r.exit_code == 2 and "--task-data gsm8k_local=PATH" in r.output

    r = qconv("check", artifact, "--text", tmp_path / "missing.txt", *WINDOW)
    assert r.exit_code == 2 and "not found" in r.output


def test_unknown_task_exit_2(artifact, text_file):
    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--tasks", "no_such_task_xyz")
    assert r.exit_code == 2 and "unknown task" in r.output


def test_quality_report_for_build(artifact, text_file, tiny_llama, tmp_path):
    """The build's entry point: reports land in the artifact, the summary carries tier, metrics and verdicts."""
    from dataclasses import replace

    from qconv.eval.record import EvalReport
    from qconv.eval.run import quality_report
    from qconv.recipes.recipe import load_recipe

    art = tmp_path / "a"
    shutil.copytree(artifact, art)
    recipe = load_recipe("3090")
    recipe.quality = replace(recipe.quality, window=64, max_tokens=256)
    s = quality_report(tiny_llama, art, recipe, text=str(text_file), kv="fp8_e4m3")
    assert {"report.json", "report.md", "kld.png"} <= {p.name for p in art.iterdir()}
    assert s.weights and s.weights.tokens == 63 * 4 and s.weights_kv and s.weights_kv.kld_mean > 0
    assert s.kv_scheme == "fp8_e4m3" and s.tier and s.tier["name"].startswith("small")
    assert isinstance(s.passed, bool) and all(not v["passed"] for v in s.verdicts)
    assert EvalReport.read(art / "report.json").weights.kld_mean == s.weights.kld_mean
    assert quality_report(tiny_llama, art, recipe, text=None).passed is None  # no text: unchecked


def test_eval_against_cached_reference(artifact, evaluated, text_file, tmp_path):
    """--reference may name a reference cache (as someone with the bf16 model computed it) instead of the model:
    the numbers are the model's own, the report says where they came from, and a cache made on another text,
    window, window count or tokenizer is refused with a clear error."""
    from tests.tiny import make_tokenizer

    out, _ = evaluated
    rep = json.loads((out / "report.json").read_text())
    cache = tmp_path / "their-cache"
    shutil.copytree(rep["reference"]["cache"], cache)  # a copy: the original cache folder is out of play

    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--reference", cache, "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    got = json.loads((tmp_path / "r" / "report.json").read_text())
    assert got["weights"] == rep["weights"]
    assert got["source"]["kind"] == "cached reference log-probs" and got["source"]["sha256"] == rep["source"]["sha256"]
    assert got["reference"]["given_as_cache"] and got["reference"]["cache"] == str(cache)
    assert got["source"]["num_parameters"] == rep["source"]["num_parameters"]
    assert f"read from the cache `{cache}`" in (tmp_path / "r" / "report.md").read_text()
    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--reference", cache / "meta.json")
    assert r.exit_code == 0, r.output

    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text()[::-1])
    wrong_tok = tmp_path / "wrong-tokenizer"
    shutil.copytree(artifact, wrong_tok)
    make_tokenizer(vocab_size=300).save_pretrained(wrong_tok)  # another BPE: other ids for the same text
    for args, msg in (
        ([artifact, "--text", other, *WINDOW], "text_sha256"),
        ([artifact, "--text", text_file, "--window", "32", "--max-tokens", "512"], "window is 64"),
        ([artifact, "--text", text_file, "--window", "64", "--max-tokens", "100000"], "has no window"),
        ([artifact, "--text", text_file, *WINDOW, "--ref-topk", "8"], "--ref-topk"),
        (
            [
                artifact,
                "--text",
                text_file,
                *WINDOW,
                "--tasks",
                "wikitext_local",
                "--task-data",
                f"wikitext_local={text_file}",
            ],
            "reference cache has none",
        ),
        ([wrong_tok, "--text", text_file, *WINDOW], "other tokens than this text gives"),
    ):
        r = qconv("eval", *args, "--reference", cache)
        assert r.exit_code == 2 and msg in r.output, (args, r.output)


def test_eval_profile_simulates_w4a8_on_its_roles_and_gates_it(artifact, text_file, tmp_path, tiny_llama):
    import torch

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.eval.actsim import act8_simulation, linears_of, quantize_per_token_int8

    x = torch.tensor([[0.5, -1.0, 0.01], [100.0, 1.0, -3.0]])
    q = quantize_per_token_int8(x)
    assert torch.allclose(q[0], x[0], atol=1.0 / 127) and q[1, 0] == 100.0  # one scale per token (row)
    model = load_causal_lm(tiny_llama)
    names = linears_of(model, ("mlp_gate_up", "mlp_down"))
    assert names and all(n.split(".")[-1] in ("gate_proj", "up_proj", "down_proj") for n in names)
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        plain = model(ids).logits
        with act8_simulation(model, ("mlp_gate_up", "mlp_down")) as hooked:
            sim = model(ids).logits
        assert hooked == len(names) and not torch.equal(plain, sim)
        assert torch.equal(model(ids).logits, plain)  # hooks removed
    r = qconv("eval", artifact, "--text", text_file, *WINDOW, "--profile", "batch", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    a8, w = rep["weights_a8"], rep["weights"]
    assert a8["kld_mean"] != w["kld_mean"] and rep["settings"]["a8_roles"] == ["mlp_gate_up", "mlp_down"]
    assert any(v["name"].startswith("weights_a8") for v in rep["verdicts"])
    bad = CliRunner().invoke(main, ["eval", str(artifact), "--text", str(text_file), *WINDOW, "--profile", "nope"])
    assert bad.exit_code == 2 and "unknown profile 'nope'" in bad.output
