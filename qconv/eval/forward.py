"""Where evaluation logits come from: the whole model loaded once, or the layer-streamed forward (layerwise.py)
when the model does not fit in the memory of the device it runs on (or when asked). Both give the same numbers
for the same windows, so the reference cache is shared between them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qconv.compute import dtype_name
from qconv.convert.device import free_bytes, resolve_device
from qconv.errors import QconvError

log = logging.getLogger(__name__)

# A whole bf16 model is loaded only when it takes at most this share of the memory free on its device: the rest is
# for one window of logits, the activations and the other model of the pair (freed before the next is loaded).
FIT_FRACTION = 0.7
Blocks = tuple[torch.Tensor, torch.Tensor]  # (logits [n, V] float32, the n tokens they predict)


@dataclass
class Forward:
    streamed: bool | None = None  # None: stream when the model does not fit (see fits)
    device: str | None = None  # None or "auto": cuda when available, else cpu
    compute_dtype: str = "auto"  # --compute-dtype (qconv.compute.resolve)

    def resolved_device(self) -> str:
        return resolve_device(self.device)

    def dtype(self) -> torch.dtype:
        from qconv.compute import resolve

        return resolve(self.compute_dtype, self.resolved_device())


def fits(num_parameters: int, device: str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a whole model of this size, computing in `dtype`, can be loaded on the device now."""
    free = free_bytes(device)
    return not free or dtype.itemsize * num_parameters <= FIT_FRACTION * free


def load_for_eval(path: str | Path, device: str, dtype: torch.dtype | None = None):
    """The whole model as evaluation runs it: its bf16 weights as transformers loads them (an artifact dequantized
    in bf16), computing in `dtype` (default: bf16 where `device` does so natively, else float32; qconv.compute)."""
    from qconv.compute import compute_dtype, upcast
    from qconv.convert.hfmodel import load_causal_lm

    model = load_causal_lm(path, device=device)
    upcast(model, dtype or compute_dtype(device))
    return model


class LogitSource:
    """Per-window logits of one model folder (a bf16 source or a compressed-tensors artifact): its bf16 weights,
    computed in bf16 where the device does that natively, else in float32 (qconv.compute)."""

    def __init__(self, path: str | Path, fwd: Forward, num_parameters: int, what: str):
        self.path, self.device = Path(path), fwd.resolved_device()
        self.dtype = fwd.dtype()
        self.streamed = fwd.streamed if fwd.streamed is not None else not fits(num_parameters, self.device, self.dtype)
        if self.streamed and fwd.streamed is None:
            log.info(
                "%s (%.1f GB in %s) does not fit in %.1f GB free on %s: layer-streamed forward",
                what,
                self.dtype.itemsize * num_parameters / 1e9,
                dtype_name(self.dtype),
                free_bytes(self.device) / 1e9,
                self.device,
            )
        self._model = None

    def logits(
        self, windows, indices: list[int], kv_scheme=None, a8_roles: tuple[str, ...] = ()
    ) -> Iterator[tuple[int, Iterator[Blocks]]]:
        """For each window i: (i, its row blocks in order), a block being (logits [n, V] float32 of positions the
        window scores, the tokens they predict). Consume a window's blocks before asking for the next window.
        `a8_roles`: those roles' linears take int8 per-token inputs (actsim.py; whole-model forward only)."""
        from qconv.eval.actsim import act8_simulation
        from qconv.eval.kvsim import kv_simulation
        from qconv.eval.reference import window_logits

        if not indices:
            return
        if self.streamed and a8_roles:
            raise QconvError(
                "the W4A8 simulation runs on the whole-model forward only",
                where="--profile",
                fix="pass --whole-model (the model must fit in memory)",
            )
        if self.streamed:
            from qconv.eval.layerwise import streamed_logits

            firsts = [windows.first_scored(i) for i in indices]
            for j, blocks in streamed_logits(
                self.path,
                [windows.ids[i] for i in indices],
                firsts,
                device=self.device,
                kv_scheme=kv_scheme,
                dtype=self.dtype,
            ):
                yield indices[j], blocks
            return
        if self._model is None:
            self._model = load_for_eval(self.path, self.device, self.dtype)  # the dtype the report states
        with kv_simulation(self._model, kv_scheme), act8_simulation(self._model, a8_roles):
            for i in indices:
                yield i, iter([window_logits(self._model, windows.ids[i], windows.first_scored(i))])

    def close(self) -> None:
        self._model = None
