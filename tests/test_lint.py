"""Issue 30.14: ruff (lint and format) and mypy on the typed core run as tests, configured in pyproject.toml. Both
tools come with the `dev` extra; a missing one fails here (CI installs it) instead of skipping."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: pip install -e '.[dev]'")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_checks_qconv_build_too():
    """ruff's default excludes skip folders named `build`; pyproject replaces them so qconv/build is linted."""
    r = _tool("ruff", "check", "--show-files")
    files = {Path(line.strip()).relative_to(REPO).as_posix() for line in r.stdout.splitlines() if line.strip()}
    assert {"qconv/build/pipeline.py", "qconv/build/options.py", "qconv/cli.py"} <= files, r.stdout[-2000:]


def test_ruff_lint_is_clean():
    r = _tool("ruff", "check", "--output-format", "concise")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_format_is_clean():
    r = _tool("ruff", "format", "--check")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_on_the_typed_core_is_clean():
    r = _tool("mypy")  # files and settings: [tool.mypy] in pyproject.toml
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
