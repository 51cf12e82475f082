"""The CLI in-process, for tests that drive `qconv` verbs."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from qconv.compute import compute_dtype

REPO = Path(__file__).resolve().parents[1]
# Calibration small enough for a tiny model. Uniform W4 unless a test asks for INT8: the 3090 recipe's budget `auto`
# would promote every unit of a tiny model (the card has room to spare); a test's own --upgrade-budget (or its old
# name --int8-budget, the same option) comes later on the command line and wins.
FAST_CAL = ["--samples", "16", "--seq-len", "64", "--upgrade-budget", "0"]
SMALL_CAL = ["--samples", "8", "--seq-len", "64"]  # smaller still, and the recipe's own upgrade budget
CPU_COMPUTE = str(compute_dtype("cpu")).removeprefix("torch.")  # what eval reports it computed in on this CPU


def run(*args):
    """`qconv ARGS` in this process; an escaping exception propagates (the test shows its traceback)."""
    from qconv.cli import main  # imported here: library tests need no other area's commands

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def build_args(recipe, model, out, *args) -> list[str]:
    """The words of `qconv build --recipe RECIPE --model MODEL --out OUT ARGS`, for `run` or a child process."""
    return [str(a) for a in ("build", "--recipe", recipe, "--model", model, "--out", out, *args)]


def build(recipe, model, out, *args):
    """`qconv build --recipe RECIPE --model MODEL --out OUT ARGS` in this process."""
    return run(*build_args(recipe, model, out, *args))


def recipe_variant(tmp_path: Path, name: str, **over) -> Path:
    """A recipe file NAME.yaml that extends the 3090 recipe with `over`."""
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"extends": "3090", **over}))
    return p
