"""lm-eval bridge on SmolLM2, offline: the shipped gsm8k_local and wikitext_local tasks run on both models."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from qconv.cli import main


@pytest.mark.slow
def test_eval_tasks_gsm8k_local_offline(smollm2, shared_data, tmp_path, monkeypatch):
    from tests.eval_helpers import make_w4_artifact

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    art = make_w4_artifact(smollm2, tmp_path / "rtn", algorithm="rtn")
    out = tmp_path / "report"
    r = CliRunner().invoke(
        main,
        [
            "eval",
            str(art),
            "--text",
            str(shared_data / "wikitext-2-raw-test.txt"),
            "--window",
            "256",
            "--max-tokens",
            "256",
            "--tasks",
            "gsm8k_local,wikitext_local",
            "--limit",
            "20",
            "--max-gen-toks",
            "32",
            "--task-data",
            f"gsm8k_local={shared_data / 'gsm8k_test.jsonl'}",
            "--task-data",
            f"wikitext_local={shared_data / 'wikitext-2-raw-test.txt'}",
            "--out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    tasks = json.loads((out / "report.json").read_text())["tasks"]
    g, w = tasks["results"]["gsm8k_local"], tasks["results"]["wikitext_local"]
    assert g["metric"] == "exact_match,flexible-extract" and g["samples"] == 20
    assert 0 <= g["base"] <= 1 and 0 <= g["quantized"] <= 1
    assert w["metric"] == "word_perplexity,none" and not w["higher_is_better"]
    assert w["quantized"] > w["base"] > 1  # 4-bit RTN costs perplexity
    assert 0 < w["recovery"] < 1
    assert "| gsm8k_local | exact_match,flexible-extract |" in r.output
