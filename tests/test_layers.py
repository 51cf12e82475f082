"""The package layer contract (pyproject.toml [tool.importlinter]): packages import only downward and no sibling
modules import each other in a cycle. import-linter sees function-level imports too, so a lazy import does not
hide an upward one."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(capsys):
    cli = pytest.importorskip("importlinter.cli", reason="import-linter is in the dev extra (pip install -e '.[dev]')")
    rc = cli.lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert rc == 0, out[-6000:]
    assert "0 broken" in out
