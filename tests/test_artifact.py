"""The typed artifact: qconv.json read once into Recipe, Profile, Speculative, Requirement and QualityReport."""

from __future__ import annotations

import json

import pytest

from qconv.artifact import Artifact
from qconv.errors import QconvError
from qconv.manifest import KV_PREFIX, QUANTIZED_EMBEDDINGS, Manifest, QualityReport, RecipeInfo, Requirement, SourceInfo
from qconv.recipes.recipe import load_recipe
from qconv.recipes.sections import Profile
from tests.eval_helpers import quality_summary


def _manifest(**kw) -> Manifest:
    r = load_recipe("3090")
    return Manifest(
        source=SourceInfo(kind="hf_dir", id="x"), recipe=RecipeInfo(r.name, r.sha256, r.to_dict()), modules=[], **kw
    )


def test_open_gives_typed_views_and_writes_the_same_json(tmp_path):
    r = load_recipe("3090")
    quality = quality_summary(tokens=64)
    req = Requirement("int8 embed_tokens", "plugin", reason="why", vllm_feature=QUANTIZED_EMBEDDINGS)
    _manifest(profiles=dict(r.profiles), speculative=r.speculative, requires=[req], quality=quality).write(tmp_path)
    art = Artifact.open(tmp_path)
    assert art.recipe == r and art.default_profile == r.default_profile
    assert art.profiles == r.profiles and isinstance(art.profiles["fast"], Profile)
    assert art.speculative == r.speculative and art.requires == [req]
    assert isinstance(art.quality, QualityReport) and art.quality.measured and art.quality.settings["window"] == 64
    data = json.loads((tmp_path / "qconv.json").read_text())
    assert data["requires"] == [
        {"feature": "int8 embed_tokens", "needs": "plugin", "reason": "why", "vllm_feature": QUANTIZED_EMBEDDINGS}
    ]  # no null keys
    assert data["speculative"]["lookup"]["max_block"] == r.speculative.lookup.max_block
    assert data["quality"] == quality and data["profiles"]["fast"]["kv_cache"] == r.profiles["fast"].kv_cache
    assert Manifest.from_dict(data).to_dict() == data
    assert art.profile("long")[1].kv_cache == r.profiles["long"].kv_cache
    with pytest.raises(QconvError, match="unknown profile 'nope'"):
        art.profile("nope")


def test_an_older_manifest_still_reads(tmp_path):
    """Written before feature tokens, per-profile max_tokens and speculation existed: the reader fills them in."""
    d = _manifest().to_dict()
    d["profiles"] = {"fast": {"kv_cache": "bf16", "context_length": 4096}}
    d["speculative"] = {}
    d["requires"] = [
        {"feature": "int8 embed_tokens", "needs": "qconv runtime or a vLLM with quantized embeddings", "reason": "r"},
        {"feature": "huge", "needs": "qconv runtime or the KVarN build of vLLM", "reason": "r"},
    ]
    d["quality"] = {"passed": None, "note": "not measured"}
    (tmp_path / "qconv.json").write_text(json.dumps(d))
    art = Artifact.open(tmp_path)
    assert art.profiles["fast"].max_tokens is None and art.speculative is None
    assert [q.vllm_feature for q in art.requires] == [QUANTIZED_EMBEDDINGS, KV_PREFIX + "kvarn"]
    assert not art.quality.measured and art.quality.passed is None
    plain = tmp_path / "plain"
    plain.mkdir()
    assert Artifact.find(plain) is None


def test_a_bad_profile_value_names_its_key(tmp_path):
    d = _manifest().to_dict()
    d["profiles"] = {"fast": {"kv_cache": "fp3", "context_length": 4096}}
    (tmp_path / "qconv.json").write_text(json.dumps(d))
    with pytest.raises(QconvError, match="profiles.fast.kv_cache") as e:
        Artifact.open(tmp_path)
    assert str(tmp_path) in e.value.where


def test_a_recipe_recorded_by_another_version_reads_with_a_warning(tmp_path, caplog):
    """Keys this qconv does not know are skipped (warned) in the recorded recipe; a user's YAML stays strict."""
    d = _manifest(profiles=dict(load_recipe("3090").profiles)).to_dict()
    d["recipe"]["resolved"]["future_key"] = "untie"
    d["recipe"]["resolved"]["quantizer"]["future_option"] = "mse"
    (tmp_path / "qconv.json").write_text(json.dumps(d))
    art = Artifact.open(tmp_path)
    assert art.recipe.quantizer == load_recipe("3090").quantizer and art.default_profile == "fast"
    assert "future_key" in caplog.text and "quantizer.future_option" in caplog.text
    bad = tmp_path / "r.yaml"
    bad.write_text('extends: "3090"\nfuture_key: untie\n')
    with pytest.raises(QconvError, match="unknown key 'future_key'"):
        load_recipe(str(bad))
