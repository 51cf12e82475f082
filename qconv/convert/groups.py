"""The layout's decisions as compressed-tensors config groups and an ignore list: what llm-compressor quantizes
and what vLLM and transformers read back from config.json."""

from __future__ import annotations

import re
from collections import defaultdict

from qconv.manifest import ModuleDecision
from qconv.models.family import all_role_patterns
from qconv.recipes.recipe import Recipe
from qconv.recipes.sections import KEEP

_PATTERN = dict(all_role_patterns())


def _role_target(role: str) -> str:
    """A role's name pattern as a compressed-tensors / vLLM target (both use re.match, anchored at the start)."""
    pat = _PATTERN[role]
    if pat.startswith("^"):
        return "re:" + pat
    if pat.startswith("(^|\\.)"):
        return "re:(.*\\.)?" + pat[len("(^|\\.)") :]
    return "re:.*" + pat


def exact_target(name: str) -> str:
    return "re:^" + re.escape(name) + "$"


def _key(m: ModuleDecision) -> tuple:
    return (m.scheme, m.bits, m.group_size, m.symmetric, _format(m))


def _format(m: ModuleDecision) -> str | None:
    """Weight-only int groups (4- and 8-bit, Linear layers, embed_tokens and lm_head alike) are `pack-quantized`:
    the one form vLLM's compressed-tensors parser takes for WNA16 (Marlin on GPUs; its embedding method for
    embed_tokens). Weight+activation schemes (w8a8) stay `int-quantized`."""
    if m.scheme == KEEP:
        return None
    if m.scheme.endswith("a16"):
        return "pack-quantized"
    return "int-quantized"


def config_groups(modules: list[ModuleDecision], recipe: Recipe) -> tuple[dict, list[str]]:
    """compressed-tensors config groups + ignore list. A role whose modules all share one decision is targeted by
    its role regex (a short config for a 64-layer model); otherwise by exact module names."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    by_role: dict[str, set] = defaultdict(set)
    for m in modules:
        by_role[m.role].add(_key(m))
    targets: dict[tuple, list[str]] = defaultdict(list)
    for m in modules:
        if m.scheme == KEEP:
            continue
        if len(by_role[m.role]) == 1:
            t = _role_target(m.role)
            if t not in targets[_key(m)]:
                targets[_key(m)].append(t)
        else:
            targets[_key(m)].append(exact_target(m.name))
    # one label, one scheme but for group_size and symmetric (validated), which the decisions carry
    schemes = {s.label: s for s in recipe.schemes.values()}
    groups = {}
    for i, (key, tg) in enumerate(sorted(targets.items(), key=lambda kv: str(kv[0]))):
        label, bits, g, sym, fmt = key
        s = schemes[label]
        w = s.weights
        wargs = QuantizationArgs(
            num_bits=bits,
            type="int",
            symmetric=sym,
            strategy=w.strategy,
            group_size=g if w.strategy == "group" else None,
            observer=recipe.quantizer.observer,
        )
        aargs = None
        if s.activations:
            a = s.activations
            aargs = QuantizationArgs(
                num_bits=a.bits, type="int", symmetric=a.symmetric, strategy=a.strategy, dynamic=a.dynamic
            )
        groups[f"group_{i}"] = QuantizationScheme(targets=tg, weights=wargs, input_activations=aargs, format=fmt)
    ignore = ["re:^mtp\\..*"]  # vLLM must leave the MTP head unquantized; transformers never builds it
    for role in sorted({m.role for m in modules if m.scheme == KEEP} - {"mtp"}):
        if all(m.scheme == KEEP for m in modules if m.role == role):
            ignore.append(_role_target(role))
        else:
            ignore.extend(exact_target(m.name) for m in modules if m.role == role and m.scheme == KEEP)
    return groups, ignore
