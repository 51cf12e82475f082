"""What an artifact needs beyond stock vLLM, recorded in qconv.json `requires` so the launcher can refuse before a
long load. Each entry names a `vllm_feature` token the launcher matches against what the user declares their vLLM
has (`qconv serve --vllm-feature TOKEN`); KV-cache entries carry their profile and are checked against the vLLM's
KV dtypes instead. Stock vLLM 0.32 was seen to reject the config of an artifact with an int8 weight-only
`int-quantized` group outright (compressed-tensors scheme parsing asserts), and it builds embed_tokens / lm_head
unquantized, so both int8 choices are listed."""

from __future__ import annotations

from qconv.convert.layout import Plan
from qconv.recipes.recipe import KEEP, Recipe

QUANTIZED_EMBEDDINGS = "quantized-embeddings"
QUANTIZED_LM_HEAD = "quantized-lm-head"
KV_PREFIX = "kv-cache:"
NEEDS_RUNTIME = ("qconv", "qconv-runtime", "native")  # needs values that no vLLM satisfies


def requirements(recipe: Recipe, plan: Plan) -> list[dict]:
    req = []
    roles = {m.role for m in plan.modules if m.scheme != KEEP}
    if "embed" in roles:
        req.append({"feature": "int8 embed_tokens", "needs": "qconv runtime or a vLLM with quantized embeddings",
                    "vllm_feature": QUANTIZED_EMBEDDINGS, "reason": "stock vLLM builds embed_tokens unquantized"})
    if "lm_head" in roles:
        req.append({"feature": "int8 lm_head", "needs": "qconv runtime or a vLLM with a quantized lm_head",
                    "vllm_feature": QUANTIZED_LM_HEAD,
                    "reason": "stock vLLM's compressed-tensors support quantizes Linear layers, not lm_head"})
    for name, p in recipe.profiles.items():
        if p.kv_cache.startswith("kvarn"):
            req.append({"feature": f"profile {name}: {p.kv_cache} KV cache", "profile": name,
                        "needs": "qconv runtime or the KVarN build of vLLM", "vllm_feature": KV_PREFIX + p.kv_cache,
                        "reason": "KVarN is not a stock vLLM kv-cache dtype"})
    return req


def vllm_feature(req: dict) -> str | None:
    """The feature token of an entry; manifests written before tokens existed are read by their wording."""
    if req.get("vllm_feature"):
        return str(req["vllm_feature"])
    needs = str(req.get("needs", "")).lower()
    if "quantized embeddings" in needs:
        return QUANTIZED_EMBEDDINGS
    if "kvarn" in needs:
        return KV_PREFIX + "kvarn"
    return None


def missing_for_vllm(requires: list[dict], profile: str, declared: set[str]) -> list[dict]:
    """Entries a vLLM with the `declared` features cannot satisfy for `profile` (KV entries are left to the
    launcher's KV dtype check, which knows what the installed vLLM accepts)."""
    out = []
    for req in requires:
        if req.get("profile") not in (None, profile):
            continue
        if str(req.get("needs", "")).lower() in NEEDS_RUNTIME:
            out.append(req)
            continue
        feat = vllm_feature(req)
        if feat is None or feat.startswith(KV_PREFIX):
            continue
        if feat not in declared:
            out.append(req)
    return out
