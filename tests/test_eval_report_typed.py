"""Issue 30.8: the eval report is typed (qconv.eval.record.EvalReport). A report the real writer produced reads back
into the same JSON, the manifest's summary keeps a subset of its metric fields, and a damaged report.json is one
QconvError naming the file and the key."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from qconv.errors import QconvError
from qconv.eval.record import EvalReport, MetricSummary
from qconv.eval.report import SUMMARY_KEYS, summary

WINDOW = dict(window=64, max_tokens=256)


@pytest.fixture(scope="module")
def written(tiny_llama, text_file, tmp_path_factory) -> tuple[Path, EvalReport]:
    """`qconv eval --kv fp8_e4m3 --profile batch --out` on a tiny RTN W4 artifact: every section written."""
    from qconv.eval.forward import Forward
    from qconv.eval.record import EvalSettings
    from qconv.eval.run import evaluate
    from tests.eval_helpers import make_w4_artifact

    art = make_w4_artifact(tiny_llama, tmp_path_factory.mktemp("art") / "tiny-rtn", algorithm="rtn")
    out = tmp_path_factory.mktemp("eval") / "r"
    settings = EvalSettings(text=str(text_file), kv="fp8_e4m3", **WINDOW)
    report = evaluate(art, settings, out=out, fwd=Forward(device="cpu"), profile="batch")
    return out / "report.json", report


def test_written_report_round_trips(written):
    path, report = written
    text = path.read_text()
    back = EvalReport.read(path)
    assert json.dumps(back.data, indent=2) + "\n" == text  # the same bytes as written
    assert back.data == report.data == json.loads(text)
    assert back.weights_kv is not None and back.weights_a8 is not None and back.verdicts is not None
    assert back.settings.a8_roles == ("mlp_gate_up", "mlp_down") and back.tier is not None
    assert isinstance(back.weights, MetricSummary) and back.weights.tokens == back.text.tokens_scored


def test_summary_keeps_a_subset_of_the_metrics(written):
    _, report = written
    assert set(SUMMARY_KEYS) < {f.name for f in fields(MetricSummary)}
    q = summary(report)
    assert q.weights is not None and q.weights.kld_mean == report.weights.kld_mean
    assert q.weights_a8 is not None and set(q.data["weights_kv"]) == set(SUMMARY_KEYS)
    assert q.data["verdicts"] == [asdict(v) for v in report.verdicts or () if not v.passed]


def test_report_from_before_optional_keys_reads(written):
    """Reports from an older qconv lack forward, kv_form, given_as_cache, source.kind and the judging keys."""
    path, _ = written
    d = json.loads(path.read_text())
    for k in ("forward", "kv_form", "weights_kv", "weights_a8", "tier", "verdicts", "passed"):
        d.pop(k)
    d["source"].pop("kind")
    d["reference"].pop("given_as_cache")
    old = EvalReport.of(d)
    assert old.forward is None and old.verdicts is None and old.source.kind is None
    assert "forward" not in old.data and "kind" not in old.data["source"]


@pytest.mark.parametrize(
    "damage, key",
    [
        (lambda d: d["weights"].update(kld_mean="high"), "weights.kld_mean"),
        (lambda d: d.pop("weights"), "weights"),
        (lambda d: d["text"].pop("tokens_scored"), "text.tokens_scored"),
        (lambda d: d.update(verdicts=[{"kind": "gate"}]), "verdicts[0].name"),
        (lambda d: d.update(extra=1), "extra"),
    ],
)
def test_malformed_report_is_one_error_naming_file_and_key(written, tmp_path, damage, key):
    path, _ = written
    d = json.loads(path.read_text())
    damage(d)
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(QconvError) as e:
        EvalReport.read(bad)
    assert str(bad) in str(e.value) and f"{key}:" in str(e.value) and "malformed eval report" in str(e.value)


def test_check_against_a_malformed_report_exits_2(written, tmp_path):
    from click.testing import CliRunner

    from qconv.cli import main

    path, report = written
    d = json.loads(path.read_text())
    d["weights"]["top1"] = None
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(d))
    args = ["check", report.artifact, "--text", report.settings.text, "--window", "64", "--max-tokens", "256"]
    r = CliRunner().invoke(main, [*args, "--against", str(bad)])
    assert r.exit_code == 2 and "weights.top1" in r.output and str(bad) in r.output, r.output


@pytest.mark.parametrize(
    "key, value", [("kld_mean", "Infinity"), ("kld_mean", "1e308"), ("top1", "-1e308"), ("ppl_ratio", "NaN")]
)
def test_check_against_an_out_of_range_report_fails_closed(written, tmp_path, key, value):
    """`check --against` a report whose kld_mean is Infinity or 1e308 (or top1 -1e308) used to pass every regression
    check vacuously with exit 0; a value outside its metric's range is now refused by the reader, exit 2."""
    from click.testing import CliRunner

    from qconv.cli import main

    path, report = written
    text = path.read_text()
    d = json.loads(text)
    old = json.dumps(d["weights"][key])
    bad = tmp_path / "r.json"
    bad.write_text(text.replace(f'"{key}": {old}', f'"{key}": {value}', 1))
    args = ["check", report.artifact, "--text", report.settings.text, "--window", "64", "--max-tokens", "256"]
    r = CliRunner().invoke(main, [*args, "--against", str(bad)])
    assert r.exit_code == 2 and f"weights.{key}:" in r.output and "outside the range" in r.output, r.output
    assert str(bad) in r.output


def test_a_regression_limit_that_overflows_fails(written):
    from qconv.eval.gates import regressions
    from qconv.manifest import KldStats
    from qconv.recipes.sections import Regression

    _, report = written
    recorded = summary(report)
    huge = KldStats(**{**asdict(recorded.weights), "kld_mean": 1e6})  # in range, but the limit times 1e308 is not
    object.__setattr__(recorded, "weights", huge)
    verdicts = regressions(report, recorded, Regression(mean_kld_rel=1e308))
    assert not next(v for v in verdicts if v.name.startswith("weights.kld_mean")).passed


def test_a_bad_against_file_is_called_by_its_name(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    with pytest.raises(QconvError) as e:
        EvalReport.read(bad)
    assert "eval report r.json is not valid JSON" in str(e.value) and "report.json" not in str(e.value).split("(")[0]


def test_a_bogus_kv_is_refused_before_the_reference_pass(written, monkeypatch):
    """`--kv bogus` was refused only after the reference model had been run over every window."""
    from click.testing import CliRunner

    from qconv.cli import main
    from qconv.eval import measure

    _, report = written
    ran = []
    monkeypatch.setattr(measure, "build_reference", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(measure, "open_cached", lambda *a, **k: ran.append(1))
    args = ["--text", report.settings.text, "--window", "64", "--max-tokens", "256", "--kv", "bogus"]
    for verb in ("eval", "check"):
        r = CliRunner().invoke(main, [verb, report.artifact, *args])
        assert r.exit_code == 2 and "unknown KV scheme 'bogus'" in r.output and ran == [], r.output
