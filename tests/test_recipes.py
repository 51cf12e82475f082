"""Recipe variants through `extends:`: a variant states only what differs from its base."""

from __future__ import annotations

import pytest

from qconv.errors import QconvError
from qconv.recipes.recipe import load_recipe


def test_3090_vllm_is_3090_with_bf16_embeddings_and_no_kvarn():
    base, var = load_recipe("3090"), load_recipe("3090-vllm")
    assert var.name == "3090-vllm" and var.roles["embed"] == var.roles["lm_head"] == "bf16"
    assert {k: v for k, v in var.roles.items() if k not in ("embed", "lm_head")} == {
        k: v for k, v in base.roles.items() if k not in ("embed", "lm_head")
    }
    assert set(var.profiles) == {"fast", "long"} and var.profiles["fast"].context_length == 32768
    assert var.profiles["fast"].kv_cache == "bf16"  # merged key by key: the base's other profile fields stay
    assert var.quality == base.quality and var.speculative == base.speculative and var.sha256 != base.sha256


def test_user_variant_relative_base_and_errors(tmp_path):
    (tmp_path / "mine.yaml").write_text('extends: "3090"\nname: mine\ncalibration: {samples: 16}\n')
    (tmp_path / "mine2.yaml").write_text("extends: mine.yaml\nname: mine2\nroles: {mlp_down: w8a16}\n")
    r = load_recipe(str(tmp_path / "mine2.yaml"))
    assert (r.name, r.calibration.samples, r.roles["mlp_down"], r.roles["attn_o"]) == ("mine2", 16, "w8a16", "w4a16")
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(QconvError, match="cycle"):
        load_recipe(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text('extends: "nope"\n')
    with pytest.raises(QconvError, match="unknown recipe 'nope'"):
        load_recipe(str(tmp_path / "c.yaml"))


def test_every_kvarn_preset_is_a_profile_choice():
    from qconv.kv import KV_SCHEME_NAMES
    from qconv.recipes.sections import KV_SCHEMES

    assert {n for n in KV_SCHEME_NAMES if n.startswith("kvarn_")} <= set(KV_SCHEMES)


def test_speculative_lookup_keys_are_validated(tmp_path):
    assert load_recipe("3090").speculative.lookup.after_saturated == 2
    for bad, key in (
        ("after_saturated: -1", "after_saturated"),
        ("max_block: 16", "max_block"),
        ("ngram_min: 5", "ngram_min"),
    ):
        p = tmp_path / "r.yaml"
        p.write_text(f'extends: "3090"\nname: r\nspeculative:\n  lookup:\n    {bad}\n')
        with pytest.raises(QconvError, match=f"speculative.lookup.{key}"):
            load_recipe(str(p))


def test_batch_profile_names_w4a8_roles(tmp_path):
    assert load_recipe("3090").profiles["batch"].w4a8 == ["mlp_gate_up", "mlp_down"]
    p = tmp_path / "r.yaml"
    p.write_text('extends: "3090"\nname: r\nprofiles:\n  batch: {w4a8: [lm_head]}\n')
    with pytest.raises(QconvError, match="profiles.batch.w4a8"):
        load_recipe(str(p))
