"""Module roles: the names a recipe speaks in, mapped onto each checkpoint's tensors by the model's family
(qconv.models: one file per family holds its role patterns and fused groups)."""

from __future__ import annotations

from qconv.models.family import Family, all_fused_roles, family_for, layer_index
from qconv.models.family import role_of as any_role_of

# Roles whose members vLLM fuses into one layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj, in_proj_qkv/z), over
# every family: a role means the same modules in each family that has it.
FUSED = all_fused_roles()


def family_of(config: dict) -> Family:
    """The Family of a config.json; an unknown model_type is one QconvError listing the families."""
    return family_for(config.get("model_type", ""), config.get("architectures") or [])


def text_config(config: dict) -> dict:
    """The language-model part of a config (qwen3_5 nests it under text_config)."""
    return config.get("text_config", config)


def role_of(module: str, family: Family | None = None) -> str | None:
    """Role of a module name (tensor name without `.weight`) under its family's patterns (every family's when not
    given), or None for norms, convs and other leftovers."""
    return family.role_of(module) if family is not None else any_role_of(module)


def unit_of(module: str, role: str) -> str:
    """The quantization unit a module belongs to: fused groups share one (layer, role) unit."""
    prefix = "mtp." if module.startswith("mtp.") else ""
    layer = layer_index(module)
    if role in FUSED and layer is not None:
        return f"{prefix}layers.{layer}.{role}"
    return module
