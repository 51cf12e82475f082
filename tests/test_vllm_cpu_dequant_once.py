"""On vLLM's CPU backend the plugin's weight-only kernel and its tied quantized head dequantize once, not per
forward (issue 32: the tied head dequantized the whole table every decode step). Runs the plugin's own functions in
the vLLM runtime's interpreter with a counting stand-in for the dequantizer; the logits stay hidden @ W.T."""

from __future__ import annotations

import subprocess

import pytest

from tests.test_serve_vllm_plugin import PLUGIN_PATH

pytestmark = pytest.mark.slow

CODE = r"""
import types, torch
from qconv_vllm import kernels, tied_head

calls = []

# the tied head: CompressedTensorsEmbeddingWNA16Int.apply as the plugin replaces it
tied_head._logits_from_packed_rows()
apply = tied_head._method().apply
table = torch.randn(20000, 8)
layer = torch.nn.Module()
layer.weight_packed = torch.zeros(20000, 2, dtype=torch.int32)
method = types.SimpleNamespace(embedding=lambda lay, ids: (calls.append(("head", len(ids))), table[ids])[1])
x = torch.randn(3, 8)
outs = [apply(method, layer, x) for _ in range(3)]
assert all(torch.allclose(o, x @ table.t(), atol=1e-5) for o in outs)
head_rows = sum(n for k, n in calls if k == "head")

# the reference WNA16 kernel's apply_weights, with a counting dequantizer
w = torch.randn(16, 32)
kernels.dequantize_rows = lambda *a: (calls.append(("linear", 1)), w.to(a[4]))[1]
K = kernels._kernel_class()
cfg = types.SimpleNamespace(weight_type=types.SimpleNamespace(size_bits=8), zero_points=False)
me = types.SimpleNamespace(config=cfg, in_features=32, _get_weight_params=lambda lay: (None, None, None))
lin = torch.nn.Module()
ys = [K.apply_weights(me, lin, torch.randn(2, 32)) for _ in range(3)]
assert all(y.shape == (2, 16) for y in ys)
print(head_rows, sum(1 for k, _ in calls if k == "linear"))
"""


def test_cpu_kernels_dequantize_once(vllm_python):
    r = subprocess.run(
        [vllm_python, "-c", CODE], capture_output=True, text=True, env={"PYTHONPATH": PLUGIN_PATH}, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    head_rows, linear_calls = map(int, r.stdout.split())
    assert head_rows == 20000, "three forwards must dequantize the 20,000-row table once"
    assert linear_calls == 1, "three forwards must dequantize the Linear's weight once"
