"""What a person sees of a long job: one line per stage with a live progress bar, everything the libraries print
(llmcompressor's loguru logger, transformers, datasets, torch and Python warnings, tqdm bars) in a log file, and
qconv's own warnings grouped instead of repeated.

The job talks to the view through log records alone, so library code stays free of display code: a record with
`extra=stage("name")` starts a stage, `extra=total(n)` sizes the current stage's bar, `extra=SHOW` puts an INFO
line on the console, `extra=note()` puts one beside the bar, `extra=log_dir(path)` says where the log file belongs
(the build's work dir), and `extra=advance(n, where)` moves the bar (convert/stream.py's GPTQ batches do, as
llmcompressor hands each batch of modules over).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

_STAGE, _REUSED, _TOTAL, _SHOW, _LOG_DIR = "qconv_stage", "qconv_reused", "qconv_total", "qconv_show", "qconv_log_dir"
_NOW, _NOTE, _ADVANCE, _WHERE = "qconv_now", "qconv_note", "qconv_advance", "qconv_where"
SHOW = {_SHOW: True}
LOG_NAME = "build.log"
PREPARING = "preparing"  # until the job names its first stage; not listed as one
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A per-module warning: "[plan: ]NAME [OUTxIN]: what is wrong"; grouped by what is wrong.
_PER_MODULE = re.compile(r"^(?P<prefix>\w+: )?(?P<name>\S+) \[(?P<out>\d+)x(?P<in>\d+)\]: (?P<what>.+)$", re.DOTALL)


def stage(name: str, reused: bool = False) -> dict:
    return {_STAGE: name, _REUSED: reused}


def total(n: int) -> dict:
    return {_TOTAL: n, _SHOW: True}


def advance(n: int, note: str = "") -> dict:
    """`n` more units of the current stage's work done (e.g. modules GPTQ quantized), `note` where it is."""
    return {_ADVANCE: n, _WHERE: note}


def log_dir(path: str | os.PathLike) -> dict:
    return {_LOG_DIR: str(path)}


def note() -> dict:
    """An INFO line (build.log) that also becomes the live bar's note: a layer's time, the ETA, device memory."""
    return {_NOTE: True}


def now() -> dict:
    """A warning the user must see when it happens (e.g. the build waits for another one), not at stage end."""
    return {_NOW: True}


def group_warnings(messages: list[str]) -> list[str]:
    """One line per kind of warning: the per-module ones ("NAME [OUTxIN]: what") become "N modules [in ..;
    out ..]: what", identical ones get a count."""
    groups: dict[str, list] = {}
    for msg in messages:
        m = _PER_MODULE.match(msg)
        key = f"{m['prefix'] or ''}{m['what']}" if m else msg
        groups.setdefault(key, []).append(m)
    lines = []
    for key, items in groups.items():
        if len(items) == 1:
            lines.append(_one(key, items[0]))
        elif items[0] is None:
            lines.append(f"{key} (x{len(items)})")
        else:
            ins = sorted({int(m["in"]) for m in items})
            outs = sorted({int(m["out"]) for m in items})
            shapes = f"in {_few(ins)}; out {_few(outs)}"
            prefix = items[0]["prefix"] or ""
            lines.append(
                f"{prefix}{len(items)} modules [{shapes}]: {items[0]['what']} — each listed in qconv.json "
                f"build.warnings"
            )
    return lines


def _one(key: str, m) -> str:
    return key if m is None else f"{m['prefix'] or ''}{m['name']} [{m['out']}x{m['in']}]: {m['what']}"


def _few(values: list[int], n: int = 4) -> str:
    return ", ".join(map(str, values[:n])) + (", …" if len(values) > n else "")


@contextlib.contextmanager
def json_stdout():
    """For --json: whatever the job prints goes to stderr; yields `emit(obj)`, which writes the one JSON object to
    the real stdout."""
    real = sys.stdout

    def emit(obj) -> None:
        real.write(json.dumps(obj, indent=None, default=str) + "\n")
        real.flush()

    with contextlib.redirect_stdout(sys.stderr):
        yield emit


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


class _Records(logging.Handler):
    """Routes qconv's records to the view: stage changes, console lines, warnings to group."""

    def __init__(self, view: JobView):
        super().__init__(logging.DEBUG)
        self.view = view

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.view.on_record(record)
        except Exception:  # noqa: BLE001  (a display problem must never fail the job)
            self.handleError(record)


@dataclass
class JobView:
    """Context manager around a job (a build): stage lines and a live bar on stderr, library output in the log.

    Without `verbose`, file descriptors 1 and 2 point at the log file for the duration, so even C-level and tqdm
    output lands there; the view writes to a copy of the terminal's stderr. With `verbose`, library output stays
    on the terminal and their log records go to both."""

    verbose: bool = False
    quantizer: bool = True  # the job runs llmcompressor: its logger is taken over (importing it takes seconds)
    log_name: str = LOG_NAME
    log_path: Path | None = None
    warned: list[str] = field(default_factory=list)
    _shown: int = 0

    def __enter__(self) -> JobView:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._exit = contextlib.ExitStack()
        fd, tmp = tempfile.mkstemp(prefix="qconv-", suffix=".log")
        self._tmp_log = Path(tmp)
        self._log = os.fdopen(fd, "w", buffering=1, errors="replace")
        self._moved = False
        redirect = not self.verbose and _fileno(sys.stdout) == 1 and _fileno(sys.stderr) == 2
        if redirect:
            sys.stdout.flush()
            sys.stderr.flush()
            self._saved_fds = (os.dup(1), os.dup(2))
            term = open(os.dup(self._saved_fds[1]), "w", buffering=1, closefd=True)
            self._exit.callback(term.close)
            os.dup2(self._log.fileno(), 1)
            os.dup2(self._log.fileno(), 2)
        else:
            self._saved_fds = None
            term = sys.stderr
            self._exit.enter_context(contextlib.redirect_stdout(sys.stderr))  # stdout is for the job's result
        self._term = term
        self.console = Console(file=term, soft_wrap=True, highlight=False)
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<13}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[note]}"),
            console=self.console,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task, self._note = None, ""
        self._stage: tuple[str, float, str] | None = None
        try:
            self._setup_logging()
            self._setup_libraries()
            if self.console.is_terminal:  # a live bar only where it can redraw (a pipe would get a stray line)
                self._progress.start()
                self._exit.callback(self._progress.stop)
        except BaseException:
            self.__exit__(*sys.exc_info())  # the terminal back before the error is shown
            raise
        self._start_stage(PREPARING, False)
        return self

    # ---- wiring ---------------------------------------------------------------------------------------------

    def _setup_logging(self) -> None:
        root = logging.getLogger()
        std = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}
        console = [h for h in root.handlers if type(h) is logging.StreamHandler and h.stream in std]
        file_handler = logging.StreamHandler(self._log)
        file_handler.setFormatter(logging.Formatter(FORMAT))
        self._file_handler = file_handler
        mine = [file_handler, _Records(self)]
        if self.verbose:
            loud = logging.StreamHandler(self._term)
            loud.setFormatter(logging.Formatter(FORMAT))
            mine.append(loud)
        level = root.level
        for h in console:
            root.removeHandler(h)
        for h in mine:
            root.addHandler(h)
        root.setLevel(min(level or logging.WARNING, logging.DEBUG if self.verbose else logging.INFO))
        logging.captureWarnings(True)
        warnings_filters = warnings.filters[:]

        def restore():
            for h in mine:
                root.removeHandler(h)
            for h in console:
                root.addHandler(h)
            root.setLevel(level)
            logging.captureWarnings(False)
            warnings.filters[:] = warnings_filters

        self._exit.callback(restore)

    def _setup_libraries(self) -> None:
        """Point llmcompressor's loguru logger and transformers'/datasets' own handlers at the view (tqdm bars write
        to file descriptor 2, which is the log already)."""
        if self.quantizer:
            with contextlib.suppress(ImportError):
                import llmcompressor  # noqa: F401  (configures loguru on import: do it before taking loguru over)
                from llmcompressor.logger import configure_logger
                from loguru import logger

                logger.remove()
                sink = logger.add(
                    self._loguru,
                    level="DEBUG" if self.verbose else "INFO",
                    format="{time:HH:mm:ss.SSS} | {function} | {level} - {message}",
                )

                def restore_loguru():
                    logger.remove(sink)
                    configure_logger()

                self._exit.callback(restore_loguru)
        for name in ("transformers", "datasets"):
            with contextlib.suppress(ImportError, AttributeError):
                lib = __import__(f"{name}.utils.logging", fromlist=["x"])
                lib.disable_default_handler()
                lib.enable_propagation()
                self._exit.callback(lib.enable_default_handler)
                self._exit.callback(lib.disable_propagation)

    def _loguru(self, message) -> None:
        text = str(message)
        self._log.write(text)
        if self.verbose:
            self._term.write(text)

    # ---- records -> display ---------------------------------------------------------------------------------

    def on_record(self, record: logging.LogRecord) -> None:
        if hasattr(record, _LOG_DIR):
            self._move_log(Path(getattr(record, _LOG_DIR)))
        if hasattr(record, _STAGE):
            self._start_stage(getattr(record, _STAGE), getattr(record, _REUSED, False))
        if hasattr(record, _TOTAL) and self._task is not None:
            self._progress.update(self._task, total=getattr(record, _TOTAL), completed=0)
        if hasattr(record, _ADVANCE) and self._task is not None:
            where = getattr(record, _WHERE, "")
            self._progress.update(
                self._task, advance=getattr(record, _ADVANCE), note=f"{where} · {self._note}" if self._note else where
            )
        if hasattr(record, _NOTE) and self._task is not None:
            self._note = record.getMessage()
            self._progress.update(self._task, note=self._note)
        if not record.name.startswith("qconv") or self.verbose:
            return
        if getattr(record, _NOW, False):
            self.console.print(f"[yellow]warning:[/yellow] {_escape(record.getMessage())}")
        elif record.levelno >= logging.WARNING:
            self.warned.append(record.getMessage())
        elif getattr(record, _SHOW, False) and self._stage:
            name, t0, _ = self._stage
            msg = record.getMessage()
            self._stage = (name, t0, msg[len(name) + 2 :] if msg.startswith(f"{name}: ") else msg)

    def _start_stage(self, name: str, reused: bool) -> None:
        if self._stage and self._stage[0] == name:
            return
        self._finish_stage()
        self._stage, self._note = (name, time.time(), "reused from the work dir" if reused else ""), ""
        self._task = self._progress.add_task(name, total=None, note="")

    def _finish_stage(self) -> None:
        if self._stage is None:
            return
        name, t0, note = self._stage
        self._progress.remove_task(self._task)
        self._task, self._stage = None, None
        if name != PREPARING:
            self.console.print(f"[green]✓[/green] {name:<13} {time.time() - t0:6.1f} s  {_escape(note)}".rstrip())
        self.flush_warnings()

    def flush_warnings(self) -> None:
        new, self._shown = self.warned[self._shown :], len(self.warned)
        for line in group_warnings(new):
            self.console.print(f"[yellow]warning:[/yellow] {_escape(line)}")

    def print(self, line: str) -> None:
        self.console.print(line)

    def _move_log(self, folder: Path) -> None:
        """The log belongs in the work dir, known only once the source is resolved: move what is written so far."""
        if self._moved:
            return
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.log_name
        self._log.flush()
        new = open(path, "w", buffering=1, errors="replace")  # noqa: SIM115  (held for the whole job)
        new.write(self._tmp_log.read_text(errors="replace"))
        new.flush()
        if self._saved_fds:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(new.fileno(), 1)
            os.dup2(new.fileno(), 2)
        old, self._log = self._log, new
        self._file_handler.setStream(new)
        old.close()
        self._tmp_log.unlink(missing_ok=True)
        self.log_path, self._moved = path, True

    def __exit__(self, exc_type, exc, tb) -> bool:
        from qconv.errors import QconvError

        if exc_type is None:
            self._finish_stage()
        else:
            if self._task is not None:
                self._progress.remove_task(self._task)
            self.flush_warnings()
        self._exit.close()
        sys.stdout.flush()
        sys.stderr.flush()
        if self._saved_fds:
            os.dup2(self._saved_fds[0], 1)
            os.dup2(self._saved_fds[1], 2)
            for fd in self._saved_fds:
                os.close(fd)
        self._log.close()
        if not self._moved:
            if exc_type is not None and not issubclass(exc_type, (QconvError, KeyboardInterrupt)):
                self.log_path = self._tmp_log  # a crash before the work dir: keep what the libraries said
            else:
                self._tmp_log.unlink(missing_ok=True)
        if exc_type is not None and self.log_path:
            print(f"log: {self.log_path}", file=sys.stderr)
        return False


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
