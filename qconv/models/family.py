"""What a model family is, in one place: the `Family` record each family file (`qconv/models/<name>.py`) defines
as its module-level `FAMILY`, and the registry built by discovering those files.

A Family holds the names a recipe speaks in (roles) and how they map onto checkpoint tensors, the projections that
vLLM and our engine fuse, the state a linear-attention layer keeps per sequence, the Transformer our engine builds
and the flags vLLM needs. Adding a family whose blocks exist is its family file plus its tiny test fixture."""

from __future__ import annotations

import importlib
import math
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from qconv.errors import QconvError

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer index in a module or tensor name (`model.layers.7.mlp.down_proj` -> 7), or None."""
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Fused:
    """Checkpoint projections concatenated along the output dim into one matrix: our engine's module `engine`
    holds `parts` in order; vLLM's module of the same group is `vllm` (None: vLLM keeps them apart)."""

    engine: str
    parts: tuple[str, ...]
    vllm: str | None = None


@dataclass(frozen=True)
class LinearState:
    """Per-sequence state of one linear-attention (Gated-DeltaNet) layer, as shapes: the causal conv's window
    (conv_dim, kernel - 1) and the recurrent matrix state (v_heads, k_dim, v_dim). The engine's cache allocates
    these shapes; the planners count their elements."""

    conv: tuple[int, int]
    recurrent: tuple[int, ...]
    ssm_dtype: str = "float32"

    @property
    def conv_dim(self) -> int:
        return self.conv[0]

    @property
    def conv_elems(self) -> int:
        return math.prod(self.conv)

    @property
    def recurrent_elems(self) -> int:
        return math.prod(self.recurrent)


def declared_layer_types(text: dict) -> tuple[str, ...]:
    """The text config's `layer_types`, or full attention in every layer when it has none."""
    return tuple(text.get("layer_types") or ["full_attention"] * int(text.get("num_hidden_layers") or 0))


def interleaved_layer_types(text: dict, *, every_key: str, every: int, other: str) -> tuple[str, ...]:
    """The config's `layer_types`, else every `text[every_key]`-th (default `every`-th) layer full attention and
    the rest `other`: how transformers' config classes derive them for configs written before they were listed."""
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    step = int(text.get(every_key) or every)
    n = int(text.get("num_hidden_layers") or 0)
    return tuple("full_attention" if (i + 1) % step == 0 else other for i in range(n))


def no_engine_options(hf: Any, spec: Any) -> dict[str, Any]:
    return {}


def no_buffers(module: Any) -> bool:
    return False


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    # (role, regex on the module name) in order, first match wins: MTP and vision first (their inner layers look
    # like the trunk's). The roles are the names a recipe assigns schemes to.
    role_patterns: tuple[tuple[str, str], ...]
    # roles whose members form one quantization unit per layer (vLLM fuses them into one layer, one scheme)
    fused_roles: frozenset[str]
    fused: tuple[Fused, ...]
    # the engine's module code: builds our Transformer from an EngineConfig (qconv.models.config)
    transformer: Callable[[Any], Any]
    # engine options of the family's blocks
    norm_offset: float = 0.0  # norms scale by (offset + w); the loader folds the offset into w
    qk_norm: bool = False
    attn_output_gate: bool = False
    offset_norms: str = r"(layernorm|q_norm|k_norm|pre_fc_norm_\w+|^norm|mtp\.norm)\.weight$"
    # EngineConfig fields the family reads from transformers' text config beyond the shared ones (attention scale,
    # logit soft-cap, ...): (hf text config, ModelSpec) -> {field: value}; a config the engine cannot run raises a
    # QconvError there
    engine_options: Callable[[Any, Any], dict[str, Any]] = no_engine_options
    # KV and state: the kind of each decoder layer ("full_attention" | "sliding_attention" | "linear_attention")
    # from the text config; the KV planner, the build's memory plan and the engine's cache count them
    layer_types: Callable[[dict], tuple[str, ...]] = declared_layer_types
    # state of a linear-attention layer from the text config (None: the family has none)
    linear_state: Callable[[dict], LinearState] | None = None
    # a meta-device transformers module's buffers that are computed, not stored, and that the default rebuild
    # (the module made again from its config) does not cover: put them back, True when done (streamed builds)
    restore_buffers: Callable[[Any], bool] = no_buffers
    # vLLM: hybrid (recurrent state + attention) models take --mamba-ssm-cache-dtype and run without prefix caching
    hybrid: bool = False
    multimodal_archs: tuple[str, ...] = ()  # wrappers vLLM loads text-only with --language-model-only
    vllm_role_modules: dict[str, str] = field(default_factory=dict)  # role -> regex on vLLM's module names (W4A8)
    # model types whose stock vLLM model passes its embed_tokens prefix to the quantization config: a quantized
    # embedding loads there without the plugin (the llama family holds types that do and types that do not)
    vllm_quantized_embed: tuple[str, ...] = ()

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.role_patterns)

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    def compiled_roles(self) -> list[tuple[str, re.Pattern]]:
        return _compiled(self.role_patterns)

    def role_of(self, module: str) -> str | None:
        """Role of a module name (tensor name without `.weight`), or None for norms, convs and other leftovers."""
        for role, pat in self.compiled_roles():
            if pat.search(module):
                return role
        return None


@cache
def _compiled(patterns: tuple[tuple[str, str], ...]) -> list[tuple[str, re.Pattern]]:
    return [(r, re.compile(p)) for r, p in patterns]


@cache
def registry() -> dict[str, Family]:
    """model_type -> Family, from every module of this package that defines `FAMILY`."""
    import qconv.models as pkg

    out: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        fam = getattr(importlib.import_module(f"qconv.models.{info.name}"), "FAMILY", None)
        if not isinstance(fam, Family):
            continue
        if stray := set(fam.vllm_quantized_embed) - set(fam.model_types):
            raise QconvError(
                f"family {fam.name}: vllm_quantized_embed names model types it does not cover: {sorted(stray)}",
                where=f"qconv/models/{info.name}.py",
                fix="list there only types of the family's model_types",
            )
        for mt in fam.model_types:
            if mt in out:
                raise QconvError(
                    f"model_type {mt!r} is claimed by two families: {out[mt].name} and {fam.name}",
                    where=f"qconv/models/{info.name}.py",
                    fix="list each model_type in one family file only",
                )
            out[mt] = fam
    return out


def families() -> list[Family]:
    """Every family once, in registry (file name) order."""
    seen: dict[str, Family] = {}
    for fam in registry().values():
        seen.setdefault(fam.name, fam)
    return list(seen.values())


def supported() -> str:
    """`llama (llama, qwen2, ...); qwen3_5 (...)`: what an error about an unsupported model lists."""
    return "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in families())


def family_for(model_type: str, archs: list | None = None, where: str = "config.json") -> Family:
    """The family of a model_type; an unknown one is one QconvError listing the families and their model types."""
    fam = registry().get(model_type)
    if fam is None:
        raise QconvError(
            f"unsupported architecture: model_type {model_type!r} {archs or []}",
            where=where,
            fix=f"qconv supports these families (model types): {supported()}; open an issue to add yours "
            "(CONTRIBUTING.md: Adding a model family)",
        )
    return fam


@cache
def all_role_patterns() -> tuple[tuple[str, str], ...]:
    """Every family's roles merged in one order that keeps each family's own order (a role joins right after its
    predecessor in its family, or in front when it has none: MTP and vision stay first)."""
    merged: list[tuple[str, str]] = []
    for fam in families():
        prev = None
        for role, pat in fam.role_patterns:
            have = dict(merged)
            if role in have:
                if have[role] != pat:
                    raise QconvError(
                        f"role {role!r} has two patterns: {have[role]!r} and {pat!r} ({fam.name})",
                        where=f"qconv/models/{fam.name}.py",
                        fix="a role means the same modules in every family: reuse its pattern or name a new role",
                    )
            else:
                at = 0 if prev is None else [r for r, _ in merged].index(prev) + 1
                merged.insert(at, (role, pat))
            prev = role
    return tuple(merged)


def all_fused_roles() -> frozenset[str]:
    return frozenset().union(*(f.fused_roles for f in families()))


def all_roles() -> tuple[str, ...]:
    return tuple(r for r, _ in all_role_patterns())


def role_of(module: str) -> str | None:
    """Role of a module name under every family's patterns (for callers that do not know the family)."""
    for role, pat in _compiled(all_role_patterns()):
        if pat.search(module):
            return role
    return None
