"""The family registry and ModelSpec (qconv.models): every family file is found, each model_type maps to one
family, an unknown one is one clear error listing them, and each tiny fixture reads into its family's spec."""

from __future__ import annotations

import json

import pytest

from qconv.errors import QconvError
from qconv.models import ModelSpec, family_for, layer_index, registry
from qconv.models.family import all_role_patterns, families
from tests.tiny import TINY_FAMILIES


def test_registry_is_discovered_from_the_family_files():
    names = {f.name for f in families()}
    assert {"llama", "qwen3_5"} <= names
    assert registry()["qwen2"].name == "llama" and registry()["qwen3_5_text"].name == "qwen3_5"
    for fam in families():  # every family builds an engine model and names its roles
        assert fam.roles and callable(fam.transformer)
        assert fam.fused_roles <= set(fam.roles)
        assert set(fam.vllm_role_modules) <= set(fam.roles)


def test_unknown_model_type_lists_the_families():
    with pytest.raises(QconvError) as e:
        family_for("gpt_bigcode", ["GPTBigCodeForCausalLM"])
    text = str(e.value) + " " + (e.value.fix or "")
    assert "gpt_bigcode" in text
    for fam in families():
        assert fam.name in text and all(mt in text for mt in fam.model_types)


def test_roles_first_match_wins_per_family():
    llama, qwen = family_for("llama"), family_for("qwen3_5")
    assert llama.role_of("model.layers.3.self_attn.k_proj") == "attn_qkv"
    assert llama.role_of("model.layers.3.linear_attn.out_proj") is None  # not a llama role
    assert qwen.role_of("mtp.layers.0.self_attn.q_proj") == "mtp"  # MTP before the trunk's patterns
    assert qwen.role_of("model.visual.blocks.0.attn.qkv") == "vision"
    assert qwen.role_of("model.language_model.layers.0.linear_attn.in_proj_z") == "gdn_qkvz"
    merged = [r for r, _ in all_role_patterns()]
    assert merged[:2] == ["mtp", "vision"] and merged.index("embed") < merged.index("gdn_qkvz")
    assert layer_index("model.language_model.layers.12.mlp.up_proj") == 12 and layer_index("lm_head") is None


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_spec_of_each_tiny_fixture(family, tiny_models):
    folder = tiny_models(family)
    spec = ModelSpec.read(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert spec.family is family_for(cfg["model_type"])
    assert (spec.layers, spec.hidden, spec.heads) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
    )
    assert spec.full_layers + spec.sliding_layers + spec.linear_layers == spec.layers
    assert bool(spec.sliding_layers) == bool(spec.sliding_window) == (family == "gemma3")
    assert (spec.linear_state is not None) == bool(spec.linear_layers)


def test_spec_of_the_27b_config(config_27b):
    spec = ModelSpec.read(config_27b)
    assert (spec.family.name, spec.weight_prefix, spec.multimodal, spec.hybrid) == (
        "qwen3_5",
        "model.language_model.",
        True,
        True,
    )
    assert spec.mtp_layers == 1 and spec.text is spec.config["text_config"]
    st = spec.linear_state
    tc = spec.text
    assert st.recurrent_elems == tc["linear_num_value_heads"] * tc["linear_key_head_dim"] * tc["linear_value_head_dim"]
