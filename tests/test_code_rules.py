"""Two of the project's code rules, checked on every module of qconv/ and the plugin (tests excepted):
- no module imports a private (`_name`) name or module of another qconv or qconv_vllm module: what others use is
  public (a library's internals are the patch tables' concern: qconv/convert/patches.py, the plugin's patches.py);
- no file is longer than MAX_LINES: one concern per file."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm"))
MAX_LINES = 400
FIRST_PARTY = ("qconv", "qconv_vllm")


def sources() -> list[Path]:
    return sorted((REPO / "qconv").rglob("*.py")) + sorted((REPO / "plugins" / "vllm" / "qconv_vllm").rglob("*.py"))


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _ours(module: str) -> bool:
    return module.split(".")[0] in FIRST_PARTY


def private_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _ours(a.name) and _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and (node.level or _ours(node.module)):
            names = [node.module] if _private(node.module) else []
            found += [(node.lineno, n) for n in names]
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _private(a.name)]
    return found


def test_no_private_name_is_imported_across_modules():
    found = [
        f"{p.relative_to(REPO)}:{line} imports {name}"
        for p in sources()
        for line, name in private_imports(ast.parse(p.read_text(), str(p)))
    ]
    assert not found, "make these public (drop the underscore) or use a public API:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code", ["from qconv.recipes.roles import _LAYER\n", "import qconv._x\n", "from .layout import _pick_group\n"]
)
def test_a_private_import_is_caught(code):
    assert private_imports(ast.parse(code))


def test_public_names_and_libraries_are_not_flagged():
    assert not private_imports(ast.parse("from qconv.recipes.roles import ROLES\nfrom torch.utils._pytree import x\n"))


def test_no_file_is_over_the_line_limit():
    long = [
        f"{p.relative_to(REPO)}: {n} lines" for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"split these (at most {MAX_LINES} lines a file, one concern each):\n" + "\n".join(long)
