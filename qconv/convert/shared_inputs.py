"""One rotation and one Hessian product per input tensor in a calibration pass. Linears that read the same tensor
(q/k/v, gate/up, the Gated-DeltaNet input projections) each had it turned by the same rotation (compressed-tensors
0.19's input hook, once per Linear) and each multiplied X·Xᵀ into its own Hessian (llm-compressor 0.14's GPTQ hook,
once per Linear). Here the first Linear computes them and the others reuse them: the rotated tensor itself, and the
Hessian copied from a Linear that has accumulated exactly the same input tensors (the same operations on the same
operands: the same bits, tests/test_shared_inputs.py). Nothing is allocated beyond what the libraries allocate, and
a rotated tensor is kept only while its input lives and until another input comes."""

from __future__ import annotations

import contextlib
import itertools
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
    turns, inputs = LastInput(), LastInput()
    serials = itertools.count()  # each distinct input tensor (and version) a GPTQ hook sees
    history: dict = {}  # Linear -> (its Hessian, the serials of the inputs that Hessian has accumulated, in order)

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
        serial, done = inputs.get(inp, (), lambda: (next(serials), []))
        own, before = history.get(module, (None, ()))
        if own is None or own() is not hessian:  # a Hessian made afresh starts a history afresh
            before = ()
        history[module] = (weakref.ref(hessian), (*before, serial))
        for past, h, n in done:  # a Linear whose Hessian saw the same inputs before this one: the same sums
            if past == before and h is not hessian and _alike(h, hessian) and _alike(n, num_samples):
                hessian.copy_(h)
                num_samples.copy_(n)
                return hessian, num_samples
        hessian, num_samples = accumulate(inp, module, hessian, num_samples)
        done.append((before, hessian, num_samples))
        return hessian, num_samples

    with patches.swap(hadamard_forward=turned, gptq_accumulate_hessian=accumulated):
        yield


def _alike(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _versioned(t):
    return t, t._version
