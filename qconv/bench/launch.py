"""Start `qconv serve` for a benchmark exactly as a user would run it (the same command in a child process, its own
process group, on a loopback port), wait until it answers, and stop the whole group (vLLM's workers included)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from qconv.errors import QconvError

HEALTH_TIMEOUT_S = 1200.0  # vLLM's CPU backend compiles for minutes on a first start


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """One clear error when something already listens on the port (before a server starts and fails on it)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise QconvError(
                f"port {port} on {host} is in use ({e.strerror})",
                where="--port",
                fix="pick another port, or leave --port out for a free one",
            ) from e


def serve_argv(args: list[str], port: int) -> list[str]:
    """The `qconv serve` command line, run by this Python."""
    return [sys.executable, "-m", "qconv.cli", "serve", *args, "--port", str(port)]


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL after `grace` seconds or if any of it is left (workers of a leader that
    already exited)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class ServerProcess:
    """`qconv serve ARGS --port PORT` in its own session on loopback; `with` waits for /health and stops it as a
    whole. Its output goes to `log` (a file) or to this process's stderr."""

    def __init__(
        self,
        args: list[str],
        port: int,
        env: dict | None = None,
        health_timeout: float = HEALTH_TIMEOUT_S,
        log: Path | None = None,
        cwd: Path | None = None,
    ):
        self.port, self.health_timeout, self.log, self.cwd = port, health_timeout, log, cwd
        self.argv = serve_argv(args, port)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def __enter__(self) -> ServerProcess:
        out = open(self.log, "ab") if self.log else sys.stderr  # noqa: SIM115 (closed with the process below)
        try:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if self.log:
                out.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise QconvError(
                    f"the server exited with {self.proc.returncode} before it answered: {' '.join(self.argv[2:])}",
                    where=str(self.log) if self.log else "qconv serve",
                    fix="its log above says why" + (f" (tail: {self.tail()})" if self.log else ""),
                )
            try:
                with urllib.request.urlopen(f"{self.root}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise QconvError(
            f"the server did not answer /health within {self.health_timeout:.0f} s",
            where=str(self.log) if self.log else "qconv serve",
        )

    def tail(self, n: int = 600) -> str:
        text = self.log.read_text(errors="replace") if self.log and self.log.is_file() else ""
        return " ".join(text[-n:].split())

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_group(self.proc)
