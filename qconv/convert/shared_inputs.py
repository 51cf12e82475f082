"""One rotation and one Hessian product per input tensor in a calibration pass. Linears that read the same tensor
(q/k/v, gate/up, the Gated-DeltaNet input projections) each had it turned by the same rotation (compressed-tensors
0.19's input hook, once per Linear) and each multiplied X·Xᵀ into its own Hessian (llm-compressor 0.14's GPTQ hook,
once per Linear). Here each is computed for the first Linear and reused by the others: the same operations on the
same operands, so the same bits (tests/test_shared_inputs.py). Each result is kept only while its input lives and
until another input comes, so nothing stays in memory longer than the input it was computed from."""

from __future__ import annotations

import contextlib
import weakref

from qconv.convert import patches


class LastInput:
    """The result computed from the last input tensor seen (its identity and version: an in-place change is a new
    input), under a key that says what else the result depends on."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._version = -1
        self._key: tuple = ()
        self._value = None

    def get(self, inp, key: tuple, compute):
        if inp.is_inference():  # no version counter: cannot tell an in-place change
            return compute()
        if self._ref is not None and self._ref() is inp and self._version == inp._version and _same(self._key, key):
            return self._value
        self.clear()
        value = compute()
        self._ref = weakref.ref(inp, self._dead)
        self._version, self._key, self._value = inp._version, key, value
        return value

    def clear(self) -> None:
        self._ref, self._key, self._value = None, (), None

    def _dead(self, ref: weakref.ref) -> None:
        if self._ref is ref:  # an older input's death does not drop a newer one's result
            self.clear()


def _same(a: tuple, b: tuple) -> bool:
    """Tensors by identity (a rotation's block is one Parameter shared by its Linears), the rest by value."""
    import torch

    return len(a) == len(b) and all(
        x is y or (not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and x == y) for x, y in zip(a, b)
    )


@contextlib.contextmanager
def shared_inputs():
    """For the duration of a oneshot run: the rotation of an input and its GPTQ Hessian product computed once per
    input tensor (module docstring)."""
    import torch

    rotate = patches.current("hadamard_forward")
    accumulate = patches.current("gptq_accumulate_hessian")
    turns, products = LastInput(), LastInput()

    def turned(self, value):
        if torch.is_grad_enabled():  # a graph to differentiate through (AutoRound's tuning): each its own
            return rotate(self, value)
        key = (self.weight, self.perm, self.args.inverse, self.args.location, self.module_type)
        out, version = turns.get(value, key, lambda: _versioned(rotate(self, value)))
        if out._version != version:  # a reader changed the rotated input in place: turn it afresh
            turns.clear()
            return turned(self, value)
        return out

    def accumulated(inp, module, hessian, num_samples):
        if type(module) is not torch.nn.Linear:
            return accumulate(inp, module, hessian, num_samples)
        key = (hessian.shape, hessian.dtype, hessian.device, num_samples.dtype, num_samples.device)
        product, added = products.get(
            inp, key, lambda: accumulate(inp, module, torch.zeros_like(hessian), torch.zeros_like(num_samples))
        )
        hessian += product  # what accumulate adds: 0 + X·Xᵀ is X·Xᵀ, bit for bit
        num_samples += added
        return hessian, num_samples

    with patches.swap(hadamard_forward=turned, gptq_accumulate_hessian=accumulated):
        yield


def _versioned(t):
    return t, t._version
