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


def built_once(name: str, recipe: str, make) -> Path:
    """An artifact built once and shared by every test and session that asks for the same thing: cached under
    CACHE/artifacts by a key of `name`, the recipe file (a built-in name or a path) and the build code it was made
    with. `make(out)` builds it into `out`; tests must not change what it gives them."""
    from qconv.fsutil import sha256_bytes
    from tests.conftest import CACHE

    recipe_file = Path(recipe) if Path(recipe).is_file() else REPO / "qconv" / "recipes" / f"{recipe}.yaml"
    code = [p for area in ("build", "convert", "calibrate") for p in sorted((REPO / "qconv" / area).glob("*.py"))]
    code += sorted((REPO / "qconv" / "recipes").glob("*.yaml"))  # a recipe's `extends` included
    key = sha256_bytes(b"".join(p.read_bytes() for p in [*code, recipe_file]) + name.encode())[:12]
    return cached(CACHE / "artifacts" / f"{name}-{key}", "qconv.json", make)


def cached(out: Path, done: str, make) -> Path:
    """`out`, made by `make(out)` unless `out/done` exists. Under a file lock: the suite's parallel workers (xdist)
    share the cache, and the second to ask waits for the first's build instead of writing into it too."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not (out / done).is_file():
            make(out)
    return out


def recipe_variant(tmp_path: Path, name: str, **over) -> Path:
    """A recipe file NAME.yaml that extends the 3090 recipe with `over`."""
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"extends": "3090", **over}))
    return p
