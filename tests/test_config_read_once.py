"""config.json is parsed once per command: `qconv serve --print-command` and the engine's load read it into one
ModelSpec (qconv.models) and hand that down; transformers' config object is built from the spec's dict."""

from __future__ import annotations

import builtins
import io
from pathlib import Path

import pytest

from tests.cli_helpers import run


@pytest.fixture
def config_opens(monkeypatch):
    """Every open() of a file named config.json (builtins.open, and io.open under Path.read_text / transformers)."""
    seen: list[Path] = []
    real = io.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "config.json":
            seen.append(Path(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return seen


def test_serve_print_command_reads_config_once(tiny_llama, config_opens):
    r = run("serve", tiny_llama, "--recipe", "3090", "--print-command")
    assert r.exit_code == 0, r.output
    assert "--max-model-len" in r.output
    assert config_opens == [tiny_llama / "config.json"]


def test_engine_load_reads_config_once(tiny_qwen3_5, config_opens):
    from qconv.engine.loader import load_for_engine

    model = load_for_engine(tiny_qwen3_5)
    assert model.config.family == "qwen3_5" and model.mtp is not None
    assert config_opens == [tiny_qwen3_5 / "config.json"]
