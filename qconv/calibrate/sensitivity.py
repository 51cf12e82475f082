"""Per-unit sensitivity: what keeping a unit at 4 bits costs against each scheme it could take instead (8 bits,
or the selection's cheaper steps such as smaller int4 groups); a fused group counts as one unit.

Two measures:
- `model_kld_scores`: the model-level truth. Every candidate unit at 8 bits (RTN) is the base; each unit in turn
  drops to 4 bits and the mean KLD of the final logits against the source, minus the base's, is its score. One
  forward pass per unit: affordable on a 135M model, not on a 27B.
- `proxy_scores`: the cheap per-layer proxy the build uses. With H = XᵀX/n from the unit's calibration inputs,
  E_b = Q_b(W) − W the b-bit rounding error and F the mean squared loss gradient at each output channel, score =
  Σ_rows F_r·(E4 H E4ᵀ − E8 H E8ᵀ)_rr. The plain layer error tr(E H Eᵀ) (no F) ignores that the rest of the
  network amplifies errors very unevenly (the last MLP's down_proj dominates), and ranks units far worse against
  the model-level measure (docs/BENCHMARKS.md, INT8 selection).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from qconv.calibrate.units import Unit
from qconv.manifest import ModuleDecision

log = logging.getLogger(__name__)


# What a forward keeps for its backward, at most, in the proxy's Fisher pass; and its most rows a batch.
BACKWARD_BYTES, MAX_ROWS = 2 << 30, 16
BASE = "base"  # the key of a unit's current (4-bit) decisions in Scores.errors
Rotated = dict[str, torch.Tensor]  # module name -> the block V of its input rotation (the recipe's quantizer.rotation)


@dataclass
class Scores:
    method: str  # "proxy" | "kld"
    values: dict[str, float] = field(default_factory=dict)  # unit -> gain of its 8-bit scheme (higher = more sensitive)
    tokens: int = 0
    gains: dict[str, dict[str, float]] = field(default_factory=dict)  # unit -> scheme -> gain over the base
    # proxy only: unit -> scheme (or BASE) -> Σ F·diag(E H Eᵀ); half of it is a second-order estimate of the
    # mean KLD the unit's rounding adds (summed over units: the predicted KLD of a selection)
    errors: dict[str, dict[str, float]] = field(default_factory=dict)

    def gain(self, unit: str, scheme: str, top: str) -> float | None:
        """What moving `unit` to `scheme` buys; None when it was not scored (scores from before steps existed)."""
        g = self.gains.get(unit, {})
        if scheme in g:
            return g[scheme]
        return self.values.get(unit) if scheme == top else None


def turned(w: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """w·V for V block-diagonal of `block` [b, b] along w's input dim (an input rotation's weight side)."""
    n, k = w.shape
    b = block.shape[0]
    return (w.reshape(n, k // b, b) @ block.to(w.dtype)).reshape(n, k)


def fake_quant(
    w: torch.Tensor, d: ModuleDecision, symmetric: bool | None = None, rotation: torch.Tensor | None = None
) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of a weight under a decision (group or per-channel; zero points when the
    decision is asymmetric, unless `symmetric` overrides it), in float32. `rotation`: the block V of the module's
    input rotation: W·V is rounded and turned back, (Q(W·V))·Vᵀ, which is what the rotated module computes with."""
    if rotation is not None:
        return turned(fake_quant(turned(w.detach().float(), rotation), d, symmetric), rotation.T)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = w.detach().float()
    n, k = w.shape
    g = d.group_size or k
    args = QuantizationArgs(
        num_bits=d.bits,
        type="int",
        symmetric=d.symmetric if symmetric is None else symmetric,
        strategy="group" if d.group_size else "channel",
        group_size=d.group_size,
    )
    wg = w.view(n, k // g, g)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    if not d.group_size:
        scale, zp = scale.view(n, 1), zp.view(n, 1)
    return fake_quantize(w, scale, zp, args)


@contextmanager
def input_hessians(mods: dict[str, torch.nn.Module], hs: dict[str, torch.Tensor]):
    """While open, Σ XᵀX (float32) of each named Linear's input is added into `hs` (name -> matrix)."""

    def add(name, x):
        x = x.detach().reshape(-1, x.shape[-1]).float()
        hs[name] = hs[name] + x.T @ x if name in hs else x.T @ x

    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: add(n, args[0])) for n, m in mods.items()]
    try:
        yield hs
    finally:
        for h in handles:
            h.remove()


class _Skip(torch.nn.Module):
    """Stands in for a decoder layer whose output is already known (its input is fed to a later layer)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _layer_index(module: str) -> int:
    from qconv.models.family import layer_index

    layer = layer_index(module)
    return layer if layer is not None and not module.startswith("mtp.") else 0


@contextmanager
def _from_layer(layers, start: int, hidden: torch.Tensor | None):
    """Run the model from decoder layer `start` on, feeding it `hidden` (the base model's input to that layer):
    a unit in layer L cannot change what layers < L compute, so they need not run again."""
    if not start or hidden is None:
        yield
        return
    saved = [layers[i] for i in range(start)]
    for i in range(start):
        layers[i] = _Skip()
    h = layers[start].register_forward_pre_hook(lambda m, args, kw: ((hidden,) + tuple(args[1:]), kw), with_kwargs=True)
    try:
        yield
    finally:
        h.remove()
        for i, layer in enumerate(saved):
            layers[i] = layer


@contextmanager
def output_fisher(mods: dict[str, torch.nn.Module], fs: dict[str, torch.Tensor]):
    """While open, every backward through a named Linear adds its output gradient's square, summed per output
    channel, into `fs` (name -> vector)."""

    def grad_hook(name):
        def hook(g):
            g2 = g.detach().float().pow(2).reshape(-1, g.shape[-1]).sum(0)
            fs[name] = fs[name] + g2 if name in fs else g2

        return hook

    def watch(name):
        def hook(module, args, out):
            out.register_hook(grad_hook(name))  # returns None: the output is left as is

        return hook

    handles = [m.register_forward_hook(watch(n)) for n, m in mods.items()]
    try:
        yield fs
    finally:
        for h in handles:
            h.remove()


def rows_per_batch(config, length: int) -> int:
    """Calibration rows of `length` tokens per forward + backward: what the forward keeps for its backward (about
    4 bytes x (10 hidden + 4 MLP widths a layer + 4 vocabulary widths) a token) stays under BACKWARD_BYTES."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, inter = text.hidden_size, getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    per_token = 4 * (text.num_hidden_layers * (10 * hidden + 4 * inter) + 4 * text.vocab_size)
    return max(1, min(MAX_ROWS, BACKWARD_BYTES // (per_token * length)))


def length_batches(ids: list[list[int]], size: Callable[[int], int]) -> Iterator[list[list[int]]]:
    """The rows grouped by length, in order of first appearance, in batches of at most `size(length)` rows."""
    by_length: dict[int, list[list[int]]] = {}
    for row in ids:
        by_length.setdefault(len(row), []).append(row)
    for length, rows in by_length.items():
        step = size(length)
        for i in range(0, len(rows), step):
            yield rows[i : i + step]


def capture_statistics(
    model, ids: list[list[int]], hessian_names: set[str], fisher_names: set[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """From one forward + backward per batch of rows of one length (rows_per_batch): H = XᵀX / n (float32) of each
    `hessian_names` Linear's input, and each `fisher_names` Linear's mean squared next-token-loss gradient per
    output channel (the diagonal empirical Fisher of the layer output: how much the rest of the model amplifies an
    error there). Returns (Hessians, Fishers, tokens). A batch's rows need no mask: they are all real tokens."""
    mods = dict(model.named_modules())
    hs: dict[str, torch.Tensor] = {}
    fs: dict[str, torch.Tensor] = {}
    tokens = targets = 0
    emb = model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda m, a, out: out.detach().requires_grad_())
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        with (
            input_hessians({n: mods[n] for n in hessian_names}, hs),
            output_fisher({n: mods[n] for n in fisher_names}, fs),
        ):
            for batch in length_batches(ids, lambda n: rows_per_batch(model.config, n)):
                x = torch.tensor(batch)
                logits = model(x).logits[:, :-1].float()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
                loss.backward()
                tokens += x.numel()
                targets += x.numel() - len(batch)
    finally:
        handle.remove()
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
    return {n: h / tokens for n, h in hs.items()}, {n: f / targets for n, f in fs.items()}, tokens


def row_errors(
    u: Unit, weights: dict[str, torch.Tensor], h: torch.Tensor, rotated: Rotated | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Per scheme (BASE: the unit's current decisions) and member, diag(E H Eᵀ): each output row's rounding error
    under that scheme, measured on the unit's input statistics H. `weights` are the members' float32 weights;
    `rotated`: the input rotation of each module the build rotates (module name -> block)."""
    rotated = rotated or {}

    def per_row(m: ModuleDecision) -> torch.Tensor:
        e = fake_quant(weights[m.name], m, rotation=rotated.get(m.name)) - weights[m.name]
        return ((e @ h) * e).sum(1)

    with torch.no_grad():
        return {
            BASE: {m.name: per_row(m) for m in u.base},
            **{o.scheme: {m.name: per_row(m) for m in o.members} for o in u.options},
        }


def proxy_from(
    units: list[Unit], rows: dict[str, dict[str, dict[str, torch.Tensor]]], fisher: dict[str, torch.Tensor], tokens: int
) -> Scores:
    """Scores from each unit's row errors (row_errors) and each member's output Fisher (capture_statistics): a scheme's
    error is Σ_members Σ_rows F_r·diag(E H Eᵀ)_r, its gain the base's error minus its own."""
    values, gains, errors = {}, {}, {}
    for u in units:
        errors[u.name] = {
            k: sum(float((fisher[name] * r).sum()) for name, r in per.items()) for k, per in rows[u.name].items()
        }
        gains[u.name] = {o.scheme: errors[u.name][BASE] - errors[u.name][o.scheme] for o in u.options}
        values[u.name] = gains[u.name][u.options[-1].scheme]
    return Scores("proxy", values, tokens, gains, errors)


def proxy_scores(model, units: list[Unit], ids: list[list[int]], rotated: Rotated | None = None) -> Scores:
    """Per unit and scheme, Σ_members Σ_rows F_r · (E H Eᵀ)_rr: each output channel's rounding error, weighted by
    how much the loss cares about that channel (capture_statistics); a scheme's gain is the base's error minus its own.
    One forward + backward per batch of rows, the whole model in memory (qconv.build.streamed_sensitivity: a layer
    at a time)."""
    mods = dict(model.named_modules())
    hs, fs, tokens = capture_statistics(
        model, ids, {u.base[0].name for u in units}, {m.name for u in units for m in u.base}
    )
    rows = {
        u.name: row_errors(
            u, {m.name: mods[m.name].weight.detach().float() for m in u.base}, hs[u.base[0].name], rotated
        )
        for u in units
    }
    return proxy_from(units, rows, fs, tokens)


def _mean_kld(
    model,
    ids: list[list[int]],
    ref: list[torch.Tensor],
    start: int = 0,
    inputs: list[dict[int, torch.Tensor]] | None = None,
) -> float:
    layers = model.get_decoder().layers
    tot, n = 0.0, 0
    with torch.no_grad():
        for j, (row, logp) in enumerate(zip(ids, ref)):
            with _from_layer(layers, start, inputs[j].get(start) if inputs else None):
                logq = torch.log_softmax(model(torch.tensor([row])).logits[0].float(), -1)
            tot += float((logp.exp() * (logp - logq)).sum())
            n += len(row)
    return tot / n


def _layer_inputs(model, ids: list[list[int]]) -> list[dict[int, torch.Tensor]]:
    """Each decoder layer's input hidden states, per sequence, in the current (base) model."""
    layers = model.get_decoder().layers
    out: list[dict[int, torch.Tensor]] = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, kw, i=i: out[-1].__setitem__(
                i, (args[0] if args else kw["hidden_states"]).detach().clone()
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for row in ids:
                out.append({})
                model(torch.tensor([row]))
    finally:
        for h in hooks:
            h.remove()
    return out


def model_kld_scores(
    model,
    units: list[Unit],
    ids: list[list[int]],
    rotated: Rotated | None = None,
    symmetric: bool | None = None,
    progress: bool = True,
) -> Scores:
    """Model-level sensitivity (see module docstring): with every other candidate at its 8-bit scheme, each unit's
    gain under a scheme is the mean KLD at its base minus the KLD at that scheme. Restores the weights on return."""
    from tqdm.auto import tqdm

    mods = dict(model.named_modules())
    with torch.no_grad():
        ref = [torch.log_softmax(model(torch.tensor([r])).logits[0].float(), -1) for r in ids]
    orig = {m.name: mods[m.name].weight.detach().clone() for u in units for m in u.base}

    def put(members):
        for m in members:
            mods[m.name].weight.data.copy_(fake_quant(orig[m.name], m, symmetric, (rotated or {}).get(m.name)))

    try:
        for u in units:
            put(u.top)
        base = _mean_kld(model, ids, ref)
        inputs = _layer_inputs(model, ids)
        values, gains = {}, {}
        for u in tqdm(units, desc="sensitivity (model KLD)", unit="unit", disable=not progress, leave=False):
            start = _layer_index(u.base[0].name)
            put(u.base)
            at_base = _mean_kld(model, ids, ref, start, inputs)
            gains[u.name] = {u.options[-1].scheme: at_base - base}
            for o in u.options[:-1]:
                put(o.members)
                gains[u.name][o.scheme] = at_base - _mean_kld(model, ids, ref, start, inputs)
            values[u.name] = at_base - base
            put(u.top)
    finally:
        for name, w in orig.items():
            mods[name].weight.data.copy_(w)
    log.info("model-level sensitivity: base KLD (all candidates at the top scheme) %.5f", base)
    return Scores("kld", values, sum(len(r) for r in ids), gains)


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
    from scipy.stats import spearmanr

    keys = sorted(set(a) & set(b))
    return float(spearmanr([a[k] for k in keys], [b[k] for k in keys]).statistic)
