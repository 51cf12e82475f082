"""Setup time from nothing, pip against uv, measured back to back on this host: a fresh virtual environment with
qconv's demo extras (gguf, eval, serve) and the CPU torch wheel of scripts/constraints-cpu.txt, each installer's
download cache emptied first. One JSON line: seconds per installer (uv's own install counted apart).

    python bench/setup_speed.py [--extras gguf,eval,serve] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "scripts" / "constraints-cpu.txt"


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def pip_setup(root: Path, extras: str, env: dict[str, str]) -> float:
    venv = root / "pip-venv"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    timed([py, "-m", "pip", "install", "-q", "--no-cache-dir", "-c", str(CONSTRAINTS), "-e", f"{REPO}[{extras}]"], env)
    return time.perf_counter() - t0


def uv_setup(root: Path, extras: str, env: dict[str, str]) -> tuple[float, float]:
    """(seconds to install uv itself with pip, seconds for the venv + install with uv)."""
    tools = root / "uv-tool"
    t_uv = timed([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--target", str(tools), "uv"], env)
    uv = str(tools / "bin" / "uv")
    venv = root / "uv-venv"
    env = {**env, "UV_CACHE_DIR": str(root / "uv-cache"), "UV_NO_PROGRESS": "1"}
    # uv does not read pip.conf: the same indexes and links, given as uv's own settings
    links = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        key, _, val = line.partition("=")
        val = val.strip("'")
        if key.endswith("find-links"):
            env["UV_FIND_LINKS"] = val
        elif key.endswith("extra-index-url"):
            env["UV_EXTRA_INDEX_URL"] = val
    t0 = time.perf_counter()
    timed([uv, "venv", "-q", str(venv)], env)
    py = str(venv / "bin" / "python")
    timed([uv, "pip", "install", "-q", "--python", py, "-c", str(CONSTRAINTS), "-e", f"{REPO}[{extras}]"], env)
    return t_uv, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="gguf,eval,serve")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip_s, uv_s, uv_install_s = [], [], []
    for _ in range(a.rounds):  # turn about, so that load and the network hit both alike
        root = Path(tempfile.mkdtemp(prefix="qconv-setup-"))
        try:
            pip_s.append(round(pip_setup(root, a.extras, env), 1))
            t_uv, t = uv_setup(root, a.extras, env)
            uv_install_s.append(round(t_uv, 1))
            uv_s.append(round(t, 1))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    cpu = platform.processor() or platform.machine()
    print(
        json.dumps(
            {
                "bench": "setup_speed",
                "extras": a.extras,
                "pip_s": pip_s,
                "uv_s": uv_s,
                "uv_self_install_s": uv_install_s,
                "cores": os.cpu_count(),
                "cpu": cpu,
                "load_1min": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
