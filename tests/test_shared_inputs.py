"""One rotation and one Hessian product per input tensor (convert.shared_inputs): a build computes each once for the
Linears that read the same tensor and writes the bytes it writes computing them once per Linear."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib

import pytest
import torch

from qconv.convert import patches
from qconv.convert.shared_inputs import LastInput
from tests.cli_helpers import FAST_CAL, build


def test_a_result_is_reused_for_the_same_input_only_and_dropped_with_it():
    memo, computed = LastInput(), []

    def compute(x, tag):
        computed.append(tag)
        return x * 2

    x = torch.ones(3)
    first = memo.get(x, ("k",), lambda: compute(x, "a"))
    assert memo.get(x, ("k",), lambda: compute(x, "b")) is first  # the same tensor: reused
    assert memo.get(x.clone(), ("k",), lambda: compute(x, "c")) is not first  # equal values, another tensor
    y = torch.ones(3)
    memo.get(y, ("k",), lambda: compute(y, "d"))
    memo.get(y, ("other",), lambda: compute(y, "e"))  # another key: what the result depends on changed
    y.add_(1)  # changed in place: a new input
    kept = memo.get(y, ("other",), lambda: compute(y, "f"))
    assert computed == ["a", "c", "d", "e", "f"] and torch.equal(kept, torch.full((3,), 4.0))
    watch = torch.empty(0)
    memo.get(watch, (), lambda: torch.zeros(2))
    x, y = None, None  # an older input's death leaves the newer result
    gc.collect()
    assert memo._value is not None
    del watch
    gc.collect()
    assert memo._value is None  # nothing outlives its input


def _weights(path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.glob("*.safetensors")))).hexdigest()


@pytest.mark.parametrize("family", ["tiny_qwen3_5", "tiny_llama"])
def test_a_rotated_gptq_build_shares_inputs_and_writes_the_same_bytes(family, request, tmp_path, calib_txt):
    """The 3090 recipe (rotation + GPTQ) with the sharing and without: the same weights, bit for bit, and fewer
    rotations and Hessian products computed (q/k/v, gate/up and the Gated-DeltaNet projections share theirs)."""
    from qconv.convert import quantize

    def counted(name):
        fn = patches.current(name)

        @functools.wraps(fn)  # the patch table checks the target's signature
        def wrapper(*a, **k):
            counts[name] += 1
            return fn(*a, **k)

        return wrapper

    model, seen = request.getfixturevalue(family), {}
    for shared in (True, False):
        counts = dict.fromkeys(("hadamard_forward", "gptq_accumulate_hessian"), 0)
        with pytest.MonkeyPatch.context() as mp, patches.swap(**{n: counted(n) for n in counts}):
            if not shared:
                mp.setattr(quantize, "shared_inputs", contextlib.nullcontext)
            out = tmp_path / f"out-{shared}"
            r = build("3090", model, out, "--dataset", calib_txt, "--work-dir", tmp_path / f"w-{shared}", *FAST_CAL)
        assert r.exit_code == 0, r.output
        seen[shared] = (_weights(out), counts)
    assert seen[True][0] == seen[False][0]
    (_, computed), (_, plain) = seen[True], seen[False]
    assert all(0 < computed[n] < plain[n] for n in plain), (computed, plain)
