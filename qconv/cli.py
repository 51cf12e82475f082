"""The `qconv` command. Each verb lives in its area's `commands.py` as a thin layer over one library call."""

from __future__ import annotations

import importlib
import logging
import sys

import click

from qconv import __version__
from qconv.errors import QconvError

# Areas that contribute verbs; each module exposes COMMANDS: list[click.Command].
COMMAND_MODULES = (
    "qconv.build.commands",
    "qconv.convert.commands",
    "qconv.eval.commands",
    "qconv.kv.commands",
    "qconv.engine.commands",
    "qconv.serve.commands",
    "qconv.hub.commands",
    "qconv.bench.commands",
)


class QconvGroup(click.Group):
    """Turns QconvError (and a full disk or a refused write anywhere, through qconv.disk.disk_error) into one clear
    message and its exit code instead of a traceback."""

    def invoke(self, ctx):
        from qconv.disk import disk_error

        try:
            return super().invoke(ctx)
        except QconvError as e:
            click.echo(f"error: {e.render()}", err=True)
            sys.exit(e.exit_code)
        except OSError as e:
            err = disk_error(e, what="cannot write", where=e.filename or ".")
            if err is None:
                raise
            click.echo(f"error: {err.render()}", err=True)
            sys.exit(err.exit_code)


@click.group(cls=QconvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconv")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging; library logs as they come.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """qconv: quantize a full-precision LLM into a small, fast, measured artifact and serve it."""
    ctx.obj = {"verbose": verbose}
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s")


def _register() -> None:
    for mod in COMMAND_MODULES:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:  # area not present in this build of qconv
                continue
            raise
        for cmd in module.COMMANDS:
            main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
