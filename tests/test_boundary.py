"""What crosses the qconv <-> qconv-vllm boundary is defined once, on the plugin's side (vLLM's environment has no
qconv): the KVarN codec, the bit packing, the feature tokens and the KV presets. qconv reads them from there; a copy
made again on either side (a function of the same name, a token or preset list written out, a shift-and-mask
unpacker) fails here. The codec's bytes are compared with qconv's KV scheme in tests/test_kvarn_vllm_codec.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm"))

from qconv_vllm import features  # noqa: E402
from qconv_vllm.kvarn_codec import Codec  # noqa: E402

PLUGIN = REPO / "plugins" / "vllm" / "qconv_vllm"
# name -> the one module that defines it
OWNERS = {
    "pack_bits": PLUGIN / "packing.py",
    "unpack_bits": PLUGIN / "packing.py",
    "unpack_int32": PLUGIN / "packing.py",
    "fp16_bytes": PLUGIN / "packing.py",
    "bytes_fp16": PLUGIN / "packing.py",
    "dequantize_rows": PLUGIN / "packing.py",
    "RecordLayout": PLUGIN / "packing.py",
    "balance": PLUGIN / "kvarn_codec.py",
    "rtn_rows": PLUGIN / "kvarn_codec.py",
    "exp32": PLUGIN / "kvarn_codec.py",
    "sylvester": PLUGIN / "kvarn_codec.py",
    "encode_side": PLUGIN / "kvarn_codec.py",
}
# The Triton kernels are the codec's port to the GPU (held to its bytes by tests/test_kvarn_triton.py), not a copy.
PORTS = {PLUGIN / "kvarn_triton.py"}


def sources() -> list[Path]:
    return sorted((REPO / "qconv").rglob("*.py")) + sorted(PLUGIN.rglob("*.py"))


def _shift_and_mask(node: ast.AST) -> bool:
    """`(x >> shifts) & mask` with a shift that varies: an unpacker of packed codes."""
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.BitAnd)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.RShift)
        and not isinstance(node.left.right, ast.Constant)
    )


def redefinitions(path: Path, tree: ast.AST) -> list[str]:
    tokens = {t for t in features.FEATURES if not t.startswith(features.KV_PREFIX)} | {features.KV_PREFIX}
    presets = set(features.KVARN_PRESETS)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in OWNERS and OWNERS[node.name] != path:
            found.append(f"{where} defines {node.name} (defined in {OWNERS[node.name].relative_to(REPO)})")
        if path == PLUGIN / "features.py":
            continue
        if isinstance(node, ast.Constant) and node.value in tokens:
            found.append(f"{where} writes the feature token {node.value!r} out (import it from qconv_vllm.features)")
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            named = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in presets]
            if set(named) == presets:  # the whole list again (a choice among them, e.g. kv/plan.py's, is a use)
                found.append(f"{where} lists the plugin's KV presets {named} (use qconv_vllm.features.KVARN_PRESETS)")
        if _shift_and_mask(node) and path != OWNERS["unpack_bits"] and path not in PORTS:
            found.append(f"{where} unpacks codes by shift and mask (use qconv_vllm.packing)")
    return found


def test_what_crosses_the_boundary_is_defined_once():
    found = [f for p in sources() for f in redefinitions(p, ast.parse(p.read_text(), str(p)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "code",
    [
        "def unpack_bits(p, b):\n    return p\n",
        "FEATURE = 'quantized-embeddings'\n",
        "P = ('kvarn_k4v2_g128', 'kvarn_k4v4_g128', 'kvarn_k4v2_g64', 'kvarn_k4v4_g64')\n",
        "def f(w, s, b):\n    return (w >> s) & ((1 << b) - 1)\n",
    ],
)
def test_a_copy_is_caught(code):
    """The check itself: each kind of copy, put in a qconv module, is found."""
    assert redefinitions(REPO / "qconv" / "kv" / "copy.py", ast.parse(code))


def test_qconv_reads_the_plugins_definitions():
    from qconv import manifest
    from qconv.kv.schemes import VLLM_PLUGIN_KVARN, get_kv_scheme
    from qconv.recipes.sections import KV_SCHEMES

    for name in ("QUANTIZED_EMBEDDINGS", "TIED_QUANTIZED_HEAD", "WNA16_8BIT_CPU", "ROTATIONS_CPU", "KV_PREFIX"):
        assert getattr(manifest, name) is getattr(features, name)
    assert VLLM_PLUGIN_KVARN is features.KVARN_PRESETS and set(features.KVARN_PRESETS) <= set(KV_SCHEMES)
    for preset in features.KVARN_PRESETS:  # what vLLM sizes a page by is what qconv's planner charges
        for d in (64, 128, 256):
            assert get_kv_scheme(preset).record_bytes(d) == Codec.from_dtype(preset, d).record_bytes


def test_qconv_distribution_carries_the_plugin_package():
    """qconv imports qconv_vllm, so its wheel must ship the package (the plugin's own distribution is vLLM's)."""
    from setuptools.config.pyprojecttoml import read_configuration

    cfg = read_configuration(REPO / "pyproject.toml", expand=True, ignore_option_errors=False)
    packages = cfg["tool"]["setuptools"]["packages"]
    assert "qconv" in packages and "qconv_vllm" in packages
