"""What an artifact needs beyond stock vLLM, recorded in qconv.json `requires` so the launcher can refuse before a
long load. Each entry names a `vllm_feature` token: the qconv-vllm plugin (plugins/vllm) announces the tokens it
provides, a user can declare more (`qconv serve --vllm-feature TOKEN`), and KV-cache entries are checked against the
KV dtypes the installed vLLM accepts. An entry with `platform` applies only to a vLLM of that platform.

Only what stock vLLM 0.32 truly lacks is listed: int8 embed_tokens / lm_head are stored `pack-quantized`, which its
compressed-tensors parser takes, and Marlin runs W8A16 lm_head on GPUs; but some of its models (llama, qwen3_5:
those not in their Family's `vllm_quantized_embed`) build embed_tokens without the quantization prefix, and its CPU
backend has no 8-bit weight-only kernel."""

from __future__ import annotations

from qconv.convert.layout import Layout
from qconv.manifest import (
    KV_PREFIX,
    QUANTIZED_EMBEDDINGS,
    ROTATIONS_CPU,
    TIED_QUANTIZED_HEAD,
    WNA16_8BIT_CPU,
    Requirement,
)
from qconv.models.family import registry
from qconv.recipes.recipe import Recipe
from qconv.recipes.sections import KEEP, KV_SCHEMES

__all__ = [
    "KV_PREFIX",
    "QUANTIZED_EMBEDDINGS",
    "ROTATIONS_CPU",
    "TIED_QUANTIZED_HEAD",
    "WNA16_8BIT_CPU",
    "missing_for_vllm",
    "unknown_features",
    "requirements",
]
# `needs` values only our engine meets (the last is its old name)
NEEDS_ENGINE = ("qconv", "qconv-engine", "native", "qconv-runtime")
PLUGIN = "the qconv-vllm plugin (qconv runtime install)"


def requirements(recipe: Recipe, plan: Layout, rotated: bool = False) -> list[Requirement]:
    """`rotated`: the artifact carries input rotations (a transform_config)."""
    req = []
    quantized = [m for m in plan.modules if m.scheme != KEEP]
    # the family says which of its model types stock vLLM builds with embed_tokens' quantization prefix
    fam = registry().get(plan.model_type)
    stock_embed = fam is not None and plan.model_type in fam.vllm_quantized_embed
    if any(m.role == "embed" for m in quantized) and not stock_embed:
        req.append(
            Requirement(
                "int8 embed_tokens",
                PLUGIN,
                vllm_feature=QUANTIZED_EMBEDDINGS,
                reason=f"stock vLLM's {plan.model_type} model builds embed_tokens without its "
                "quantization prefix, so the weights do not load",
            )
        )
    if plan.tied_embeddings and any(m.role == "embed" for m in quantized):
        req.append(
            Requirement(
                "lm_head tied to a quantized embed_tokens",
                PLUGIN,
                vllm_feature=TIED_QUANTIZED_HEAD,
                reason="vLLM ties lm_head to embed_tokens.weight, which a pack-quantized embedding "
                "does not have (its embedding method does lookups only)",
            )
        )
    if any(m.bits == 8 and m.scheme.endswith("a16") for m in quantized):
        req.append(
            Requirement(
                "8-bit weight-only layers (lm_head)",
                PLUGIN,
                platform="cpu",
                vllm_feature=WNA16_8BIT_CPU,
                reason="vLLM's CPU backend has WNA16 kernels for 4-bit weights only (Marlin runs W8A16 on GPUs)",
            )
        )
    if rotated:
        req.append(
            Requirement(
                "input rotations",
                PLUGIN,
                platform="cpu",
                vllm_feature=ROTATIONS_CPU,
                reason="vLLM's CPU backend runs a rotation's block matmul through a GEMM its transform module "
                "does not set up (GPUs run it as is)",
            )
        )
    for name, p in recipe.profiles.items():
        if p.kv_cache.startswith("kvarn"):
            req.append(
                Requirement(
                    f"profile {name}: {p.kv_cache} KV cache",
                    PLUGIN,
                    profile=name,
                    vllm_feature=KV_PREFIX + p.kv_cache,
                    reason="KVarN is not a stock vLLM kv-cache dtype; the plugin adds its attention "
                    "backend for the presets it names in its features",
                )
            )
    return req


def missing_for_vllm(
    requires: list[Requirement], profile: str, declared: set[str], platform: str | None = None
) -> list[Requirement]:
    """Entries a vLLM with the `declared` features on `platform` ("cuda" | "cpu"; None: any) cannot satisfy for
    `profile`. A KV entry is met by its `kv-cache:<dtype>` token (the plugin's KVarN presets); only entries
    written before tokens named the preset (`kv-cache:kvarn`) are left to the launcher's KV dtype check."""
    out = []
    for req in requires:
        if req.profile not in (None, profile):
            continue
        if req.platform and platform and req.platform != platform:
            continue
        if req.needs.lower() in NEEDS_ENGINE:
            out.append(req)
            continue
        feat = req.vllm_feature
        if feat is None or feat == KV_PREFIX + "kvarn":
            continue
        if feat not in declared:
            out.append(req)
    return out


# every `vllm_feature` token this qconv writes (or read from older wording): another is a need it cannot judge
KNOWN_FEATURES = frozenset(
    {QUANTIZED_EMBEDDINGS, TIED_QUANTIZED_HEAD, WNA16_8BIT_CPU, ROTATIONS_CPU, KV_PREFIX + "kvarn"}
    | {KV_PREFIX + k for k in KV_SCHEMES}
)


def unknown_features(requires: list[Requirement], profile: str, declared: set[str] = frozenset()) -> list[Requirement]:
    """Entries for `profile` whose token this qconv does not know and the user did not declare (`--vllm-feature`):
    neither its engine nor a vLLM command line it prints can be said to meet them."""
    return [
        r
        for r in requires
        if r.profile in (None, profile) and r.vllm_feature and r.vllm_feature not in KNOWN_FEATURES | declared
    ]
