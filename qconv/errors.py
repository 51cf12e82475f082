"""Error types the CLI turns into exit codes: bad input is 2, a failed quality gate is 1."""

from __future__ import annotations

from typing import Any


class QconvError(Exception):
    """A user-facing error: what went wrong, where, and how to fix it. Exit code 2."""

    exit_code = 2

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.render())

    def render(self) -> str:
        msg = self.what
        if self.where:
            msg += f" ({self.where})"
        if self.fix:
            msg += f"\n  fix: {self.fix}"
        return msg


class GateFailure(QconvError):
    """A quality gate or regression check failed. Exit code 1."""

    exit_code = 1
    report: Any = None  # the measurement behind the verdict (a qconv.eval.record.EvalReport), for `--json`
