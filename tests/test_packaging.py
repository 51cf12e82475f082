"""qconv installs as a new user would: ranges in the metadata (the CPU torch is a constraints-file choice of the
scripts), every README extra resolves, and the vLLM plugin is a distribution of its own that pulls nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]


def _deps() -> dict[str, str]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) + [r for extra in meta["optional-dependencies"].values() for r in extra]
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower(): r for r in reqs}


def test_metadata_states_ranges_not_pins():
    deps = _deps()
    for name in ("torch", "transformers", "compressed-tensors", "llmcompressor"):
        assert "==" not in deps[name], deps[name]
    assert "vllm" not in deps  # vLLM lives in its own runtime venv (qconv runtime install)
    assert "torch==2.13.0" in (REPO / "scripts" / "constraints-cpu.txt").read_text()
    plugin = tomllib.loads((REPO / "plugins" / "vllm" / "pyproject.toml").read_text())["project"]
    assert plugin["dependencies"] == [] and "qconv" not in json.dumps(plugin.get("dependencies"))


def _dry_run(venv: Path, *args: str) -> list[str]:
    r = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            "-",
            "--disable-pip-version-check",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout[r.stdout.index("{") :])
    return [f"{i['metadata']['name'].lower()}=={i['metadata']['version']}" for i in report["install"]]


@pytest.mark.slow
def test_fresh_venv_resolves_qconv_dev_and_the_plugin(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = ("-c", str(REPO / "scripts" / "constraints-cpu.txt"))
    for spec in (".", ".[dev]"):
        got = _dry_run(venv, *constraints, "-e", spec)
        torch = [p for p in got if p.startswith("torch==")]
        assert torch and torch[0].startswith("torch==2.13.0"), torch
        assert not any(p.startswith(("vllm", "llama-cpp-python")) for p in got), got
    plugin = _dry_run(venv, str(REPO / "plugins" / "vllm"))
    assert [p.split("==")[0] for p in plugin] == ["qconv-vllm"]
