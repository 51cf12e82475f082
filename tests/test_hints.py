"""Issue 30, point 2: a hint qconv prints runs where it is printed, or names its install step. `qconv serve` on
qconv's own engine, in an environment without the `serve` extra (the state `pip install qconv` leaves), says
"pip install 'qconv[serve]'" in one clear error instead of an import traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

NO_SERVE_EXTRA = (
    "import sys\n"
    "for m in ('uvicorn', 'fastapi', 'prometheus_client'): sys.modules[m] = None  # not installed\n"
    "from qconv.cli import main\nmain(sys.argv[1:])\n"
)


@pytest.mark.parametrize("backend", ["native", "auto"])
def test_serve_without_the_serve_extra_names_the_install(tiny_qwen3, tmp_path, backend):
    env = {
        "QCONV_HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    r = subprocess.run(
        [sys.executable, "-c", NO_SERVE_EXTRA, "serve", str(tiny_qwen3), "--backend", backend, "--port", "18399"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr and "pip install 'qconv[serve]'" in r.stderr
    assert "uvicorn" in r.stderr
