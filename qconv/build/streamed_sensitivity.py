"""The sensitivity proxy (qconv.calibrate.sensitivity.proxy_scores) one decoder layer at a time, for a streamed
build: the same H, the same Fisher and the same row errors without ever holding the model.

Forward, layer by layer (qconv.eval.layerwise.StreamedModel reads each from safetensors and drops it): every
calibration window is pushed through layer i while its candidate units' input Hessians accumulate; the unit's row
errors are taken from the loaded weights; the layer's inputs are spilled to disk (the backward needs them).
Then the final norm + lm_head score the windows in row blocks and give the loss gradient at the last hidden state.
Backward, layer by layer in reverse: the layer is loaded again, rerun on its spilled inputs with autograd, and the
gradient is pulled through it while the members' output Fishers accumulate.
Peak memory: one layer + one window's activations + the windows' hidden states and gradients (bf16) + the
largest unit's H; the spilled inputs (windows x tokens x hidden x depth) live on disk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from qconv.calibrate.sensitivity import Rotated, Scores, input_hessians, output_fisher, proxy_from, row_errors
from qconv.calibrate.units import Unit
from qconv.convert.stream import Spilled
from qconv.errors import QconvError
from qconv.eval.layerwise import StreamedModel, layer_output

HEAD_ROWS = 128  # positions per lm_head forward + backward: float32 logits, softmax and gradient are each rows x vocab


def members_by_layer(units: list[Unit], n_layers: int | None = None) -> dict[int, dict[str, str]]:
    """layer index -> {member name: its name inside the layer}; every member must sit in a decoder layer (a
    streamed build checks this before it writes anything)."""
    from qconv.models.family import LAYER

    out: dict[int, dict[str, str]] = {}
    for u in units:
        for m in u.base:
            hit = LAYER.search(m.name)
            if m.name.startswith("mtp.") or hit is None or (n_layers is not None and int(hit.group(1)) >= n_layers):
                raise QconvError(
                    f"INT8 candidate {m.name} ({u.role}) is not in a decoder layer: a streamed build "
                    "scores decoder layers only",
                    where="selection.candidates",
                    fix=f"drop {u.role} from selection.candidates, or build in memory (no --stream)",
                )
            out.setdefault(int(hit.group(1)), {})[m.name] = m.name[hit.end() :]
    return out


def _trainable_copy(x):
    """Inputs captured in inference mode, as ordinary tensors autograd can save."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def streamed_proxy_scores(
    path: str | Path,
    units: list[Unit],
    ids: list[list[int]],
    spill: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    rotated: Rotated | None = None,
) -> Scores:
    """proxy_scores for the model at `path` read a layer at a time, computing in `dtype`; the layers' inputs are
    spilled under `spill`."""
    sm = StreamedModel.open(path, device, dtype=dtype)
    layers = sm.model.get_decoder().layers
    by_layer = members_by_layer(units, len(layers))
    first = {u.base[0].name for u in units}
    lengths = sorted({len(r) for r in ids})
    extra = {t: {i: _trainable_copy(c) for i, c in sm.layer_inputs(t).items()} for t in lengths}
    hidden = [sm.embed([r])[0] for r in ids]  # [T, H] each, in dtype
    saved: list[list[Spilled]] = []
    rows: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    tokens = sum(len(r) for r in ids)

    def run(i: int, layer, x: torch.Tensor) -> torch.Tensor:
        args, kwargs = extra[x.shape[0]][i]
        return layer_output(layer(x.unsqueeze(0).to(sm.device), *args, **kwargs))[0]

    from tqdm.auto import tqdm

    for i, layer in enumerate(tqdm(layers, desc="sensitivity forward", unit="layer", leave=False)):
        saved.append([Spilled(h, spill) for h in hidden])
        local = by_layer.get(i, {})
        with sm.loaded(layer, f"decoder layer {i}"), torch.no_grad():
            hs: dict[str, torch.Tensor] = {}
            watched = {n: layer.get_submodule(loc) for n, loc in local.items() if n in first}
            with input_hessians(watched, hs):
                hidden = [run(i, layer, h).to(h.device) for h in hidden]
            for u in units:
                if u.base[0].name in watched:
                    weights = {m.name: layer.get_submodule(local[m.name]).weight.float() for m in u.base}
                    rows[u.name] = row_errors(u, weights, hs[u.base[0].name] / tokens, rotated)

    grads, predicted = [], 0
    with sm.head() as (norm, head):  # the loss gradient at the last hidden state, row blocks at a time
        _frozen(norm), _frozen(head)
        for r, h in zip(ids, hidden):
            h = h.detach().to(sm.device).requires_grad_()
            target = torch.tensor(r[1:], device=sm.device)
            for a in range(0, len(r) - 1, HEAD_ROWS):
                b = min(a + HEAD_ROWS, len(r) - 1)
                logits = head(norm(h[a:b])).float()
                torch.nn.functional.cross_entropy(logits, target[a:b], reduction="sum").backward()
            grads.append(h.grad.cpu())
            predicted += len(r) - 1
    del hidden

    fs: dict[str, torch.Tensor] = {}
    for i in tqdm(
        reversed(range(len(layers))), total=len(layers), desc="sensitivity backward", unit="layer", leave=False
    ):  # the Fisher of every member's output
        layer, local = layers[i], by_layer.get(i, {})
        with (
            sm.loaded(layer, f"decoder layer {i}"),
            output_fisher({n: layer.get_submodule(loc) for n, loc in local.items()}, fs),
        ):
            _frozen(layer)
            for w, s in enumerate(saved[i]):
                x = s.load().to(sm.device).requires_grad_()
                run(i, layer, x).backward(grads[w].to(sm.device))
                grads[w] = x.grad.cpu()
        saved[i] = []  # its files go with it
    return proxy_from(units, rows, {n: f / predicted for n, f in fs.items()}, tokens)
