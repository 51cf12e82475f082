"""The build as a person sees it (issue 20): a short terminal, library logs in build.log, a summary with the quality
table and verdict, files readable by others; --json for scripts; warnings grouped; offline found once; the copy
workload reading normally wrapped text."""

from __future__ import annotations

import collections
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests import cli_helpers
from tests.tiny import CORPUS

REPO = Path(__file__).resolve().parents[1]
FAST = ["--samples", "16", "--seq-len", "64"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ux")
    (d / "cal.txt").write_text(CORPUS * 20)
    (d / "held.txt").write_text(CORPUS * 3)
    (d / "tiny.yaml").write_text('extends: "3090"\nname: tiny\nquality: {window: 64, max_tokens: 512}\n')
    return {"cal": d / "cal.txt", "held": d / "held.txt", "recipe": d / "tiny.yaml"}


def qconv_subprocess(*args, home: Path) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: real file descriptors, so C-level and tqdm output would show if not captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "QCONV_HOME": str(home)}
    env.pop("HF_HUB_OFFLINE", None)  # the build finds out by itself
    return subprocess.run(
        [sys.executable, "-m", "qconv.cli", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.umask(0o022),
        timeout=600,
        check=False,
    )


def build_args(model, out, texts, *extra):
    return [
        *cli_helpers.build_args(texts["recipe"], model, out),
        "--dataset",
        texts["cal"],
        "--eval-text",
        texts["held"],
        *FAST,
        *extra,
    ]


def test_build_terminal_is_short_and_the_log_has_the_rest(tiny_llama, texts, tmp_path):
    out = tmp_path / "art"
    r = qconv_subprocess(*build_args(tiny_llama, out, texts, "--eval-tokens", "256"), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    lines = (r.stdout + r.stderr).splitlines()
    assert len(lines) < 40, "\n".join(lines)
    repeated = {ln: n for ln, n in collections.Counter(ln for ln in lines if ln.strip()).items() if n > 2}
    assert not repeated, repeated
    # the closing summary: size, quality table with and without KV quantization, verdict with tier, next commands
    assert "bits per weight" in r.stdout and "source" in r.stdout
    assert "mean KLD" in r.stdout and "p99 KLD" in r.stdout and "PPL ratio" in r.stdout
    assert "weights only" in r.stdout and "weights + KV kvarn_k4v2_g128" in r.stdout
    assert "PASSED" in r.stdout and "small tier" in r.stdout
    # --eval-tokens: 4 windows of 64 scored, said in the verdict and recorded as the recipe built with
    assert "on 252 tokens of held.txt" in r.stdout, r.stdout
    m = json.loads((out / "qconv.json").read_text())
    assert m["recipe"]["resolved"]["quality"]["max_tokens"] == 256 and m["quality"]["text"]["windows"] == 4
    assert str(out / "report.md") in r.stdout and str(out / "kld.png") in r.stdout
    assert f"qconv serve {out}" in r.stdout and f"qconv check {out}" in r.stdout
    # one line per stage, grouped warnings, no library chatter on the terminal
    for stage in ("import", "calibration", "quantization", "packaging", "quality"):
        assert any(ln.startswith(f"✓ {stage}") for ln in r.stderr.splitlines()), r.stderr
    assert "warning: plan: tied embeddings kept tied" in r.stderr
    assert "compress_module_list" not in r.stderr + r.stdout and "Compression lifecycle" not in r.stderr
    assert "offline:" in r.stderr
    # the library logs are in build.log, inside the work dir
    logs = list((tmp_path / "home" / "work").glob("*/build.log"))
    assert len(logs) == 1 and f"log       {logs[0]}" in r.stdout
    log = logs[0].read_text()
    assert "compress_module_list" in log and "Quantizing 1 module(s)" in log  # llmcompressor (loguru)
    assert "Quantizing 2 module(s)" in log  # a layer's same-shape Linears (q/o, gate/up) in one GPTQ batch on the CPU
    assert "Compression lifecycle" in log and "qconv.build.workdir: stage quantization" in log
    # files as save_pretrained would leave them under umask 022
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {"model.safetensors", "qconv.json", "report.json", "report.md"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


@pytest.mark.slow
def test_build_json_and_verbose(tiny_llama, texts, tmp_path):
    """--json: exactly one JSON object on stdout, even with -v streaming the library logs to stderr."""
    out = tmp_path / "art"
    r = qconv_subprocess("-v", *build_args(tiny_llama, out, texts, "--json"), home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["artifact"] == str(out.resolve()) and summary["passed"] is True and summary["status"] == "ok"
    assert set(summary["quality"]) == {"weights", "weights_kv"} and summary["kv_scheme"] == "kvarn_k4v2_g128"
    assert 0 < summary["size_bytes"] < summary["source_bytes"] and 4 < summary["bits_per_weight"] < 16
    assert summary["calibration"]["samples"] == 16 and Path(summary["log"]).is_file()
    assert "Quantizing 1 module(s)" in r.stderr  # -v: the library logs as they come


@pytest.mark.slow
def test_int8_table_only_when_something_is_selected(tiny_qwen3_5, texts, tmp_path):
    from qconv.cli import main

    base = [
        "build",
        "--recipe",
        "3090",
        "--model",
        tiny_qwen3_5,
        "--dataset",
        texts["cal"],
        *FAST,
        "--work-dir",
        tmp_path / "w",
    ]
    r = CliRunner().invoke(main, [*map(str, base), "--out", str(tmp_path / "zero")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "upgrade selection" not in r.output and "not measured" in r.output
    r = CliRunner().invoke(
        main, [*map(str, base), "--out", str(tmp_path / "all"), "--int8-budget", "1TB"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    table = [ln for ln in r.output.splitlines() if ln.startswith(("  layers.", "  model."))]
    assert "upgrade selection" in r.output and 0 < len(table) <= 10 and "more units (all in qconv.json" in r.output


def test_group_warnings():
    from qconv.progress import group_warnings

    shape = "vLLM's Marlin kernel cannot run this shape; vLLM falls back to a slower kernel"
    msgs = [f"plan: model.layers.{i}.mlp.up_proj [1536x576]: {shape}" for i in range(30)]
    msgs += [f"plan: model.layers.{i}.self_attn.k_proj [192x576]: {shape}" for i in range(30)]
    msgs += ["plan: lm_head [49152x576]: " + shape, "something else", "something else", "plan: x [4x4]: other"]
    assert group_warnings(msgs) == [
        f"plan: 61 modules [in 576; out 192, 1536, 49152]: {shape} — each listed in qconv.json build.warnings",
        "something else (x2)",
        "plan: x [4x4]: other",
    ]


def test_offline_found_once_and_put_back(monkeypatch):
    import huggingface_hub.constants as hc

    from qconv.offline import offline_if_unreachable

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    before = hc.HF_HUB_OFFLINE
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with offline_if_unreachable() as note:
        assert note and f"127.0.0.1:{port} unreachable" in note
        assert os.environ["HF_HUB_OFFLINE"] == "1" and hc.HF_HUB_OFFLINE is True
    assert "HF_HUB_OFFLINE" not in os.environ and hc.HF_HUB_OFFLINE == before
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.getsockname()[1]}")
        with offline_if_unreachable() as note:
            assert note is None and "HF_HUB_OFFLINE" not in os.environ


def test_files_get_the_umask_mode(tmp_path):
    from qconv.fsutil import atomic_dir, write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
        with atomic_dir(tmp_path / "d") as d:
            (d / "private.bin").write_bytes(b"x")
            (d / "private.bin").chmod(0o600)  # what mkstemp and safetensors' writer leave
            (d / "run.sh").write_text("#!/bin/sh\n")
            (d / "run.sh").chmod(0o700)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "d", *(tmp_path / "d").iterdir()]}
        assert modes == {"d": 0o755, "private.bin": 0o644, "run.sh": 0o755}
        os.umask(0o077)
        write_text_atomic(tmp_path / "b.txt", "x")
        assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o600  # a private umask stays private
    finally:
        os.umask(old)


def test_eval_and_check_json(tiny_llama, texts, tmp_path):
    from qconv.cli import main
    from tests.eval_helpers import make_w4_artifact

    art = make_w4_artifact(tiny_llama, tmp_path / "rtn", algorithm="rtn")
    window = ["--window", "64", "--max-tokens", "256"]
    r = CliRunner().invoke(main, ["eval", str(art), "--text", str(texts["held"]), *window, "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["weights"]["tokens"] > 0 and "passed" in report
    r = CliRunner().invoke(main, ["check", str(art), "--text", str(texts["held"]), *window, "--json"])
    assert r.exit_code in (0, 1), r.output
    report = json.loads(r.stdout)
    assert report["passed"] is (r.exit_code == 0) and any(v["kind"] == "files" for v in report["verdicts"])


def test_eval_tokens_below_one_window_is_refused_before_any_work(tiny_llama, texts, tmp_path):
    out = tmp_path / "art"
    r = qconv_subprocess(*build_args(tiny_llama, out, texts, "--eval-tokens", "63"), home=tmp_path / "home")
    assert r.returncode != 0 and not out.exists()
    assert "--eval-tokens 63 is less than one window of the quality report (64 tokens" in r.stderr, r.stderr
    assert "pass --eval-tokens 64 or more" in r.stderr
