"""Issue 21: the quantizer's recipe keys (actorder, observer, awq+gptq), tied embeddings kept tied, the embedding's
own scheme and the --bpw target: each validated, each shown to reach llmcompressor / the artifact."""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import SMALL_CAL, build, recipe_variant


@pytest.mark.parametrize(
    "quantizer, expect",
    [
        ({"actorder": "group"}, r"quantizer\.actorder: actorder 'group' cannot be built: compressed-tensors 0\.19"),
        ({"actorder": "dynamic"}, r"quantizer\.actorder: actorder 'dynamic' cannot be built"),
        ({"actorder": "colum"}, r"quantizer\.actorder: bad value 'colum'; allowed: 'weight', 'static'"),
        ({"algorithm": "rtn", "actorder": "weight"}, r"quantizer\.actorder: act-order is a GPTQ option"),
        ({"observer": "mes"}, r"quantizer\.observer: bad value 'mes'; allowed: 'minmax', 'mse'.*did you mean 'mse'"),
        ({"algorithm": "awq"}, r"quantizer\.algorithm: bad value 'awq'; allowed: 'gptq', 'rtn', 'awq\+gptq'"),
        ({"algorithm": "autoround", "actorder": None, "iters": 0}, r"quantizer\.iters: must be >= 1"),
        ({"algorithm": "autoround", "actorder": "weight"}, r"quantizer\.actorder: act-order is a GPTQ option"),
    ],
)
def test_quantizer_keys_validated(tmp_path, quantizer, expect):
    from qconv.recipes.recipe import load_recipe
    from qconv.recipes.schema import SchemaError

    with pytest.raises(SchemaError, match="(?s)" + expect):
        load_recipe(str(recipe_variant(tmp_path, "bad", quantizer=quantizer)))


def test_tied_embeddings_and_scheme_labels_validated(tmp_path):
    from qconv.recipes.recipe import load_recipe
    from qconv.recipes.schema import SchemaError

    with pytest.raises(SchemaError, match=r"tied_embeddings: bad value 'share'; allowed: 'keep', 'untie'"):
        load_recipe(str(recipe_variant(tmp_path, "t", tied_embeddings="share")))
    channel = {"weights": {"bits": 4, "symmetric": True, "strategy": "channel", "group_size": None}}
    with pytest.raises(SchemaError, match=r"schemes\.w4a16_g32: shares the label w4a16"):
        load_recipe(str(recipe_variant(tmp_path, "s", schemes={"w4a16_g32": channel})))


def test_actorder_and_observer_reach_llmcompressor(tmp_path, tiny_llama):
    """GPTQModifier turns a scheme's actorder null into "static" by default; the recipe's null must stay null."""
    from compressed_tensors.quantization import ActivationOrdering

    from qconv.convert.layout import plan_model
    from qconv.convert.quantize import config_groups, modifiers
    from qconv.convert.sources import read_config
    from qconv.recipes.recipe import load_recipe

    config = read_config(tiny_llama)
    for actorder, observer, want in ((None, "minmax", None), ("weight", "mse", ActivationOrdering.WEIGHT)):
        recipe = load_recipe(
            str(recipe_variant(tmp_path, f"a{actorder}", quantizer={"actorder": actorder, "observer": observer}))
        )
        plan = plan_model(tiny_llama, config, recipe)
        groups, ignore = config_groups(plan.modules, recipe)
        assert {g.weights.observer for g in groups.values()} == {observer}
        (gptq,) = modifiers(None, recipe, groups, ignore)
        resolved = gptq.resolve_quantization_config()
        assert {g.weights.actorder for g in resolved.config_groups.values()} == {want}


def test_awq_uses_llmcompressor_mappings_and_refuses_unknown(tiny_llama, tmp_path):
    import torch

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.quantize import awq_mappings, modifiers
    from qconv.errors import QconvError
    from qconv.recipes.recipe import load_recipe

    model = load_causal_lm(tiny_llama)
    recipe = load_recipe(str(recipe_variant(tmp_path, "awq", quantizer={"algorithm": "awq+gptq"})))
    awq, gptq = modifiers(model, recipe, {}, [])
    assert type(awq).__name__ == "AWQModifier" and type(gptq).__name__ == "GPTQModifier"
    assert any("post_attention_layernorm" in m.smooth_layer for m in awq.mappings)

    class Unknown(torch.nn.Module):
        pass

    with pytest.raises(QconvError, match="no AWQ smoothing mappings for Unknown"):
        awq_mappings(Unknown())


def test_observer_changes_the_weights(tiny_llama, tmp_path, calib_txt):
    """RTN with min/max vs MSE-searched scales: the same recipe otherwise, different int4 codes."""
    from safetensors import safe_open

    packed = {}
    for obs in ("minmax", "mse"):
        out = tmp_path / obs
        r = build(
            recipe_variant(tmp_path, obs, quantizer={"algorithm": "rtn", "actorder": None, "observer": obs}),
            tiny_llama,
            out,
            "--dataset",
            calib_txt,
            *SMALL_CAL,
            "--no-gates",
        )
        assert r.exit_code == 0, r.output
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert {g["weights"]["observer"] for g in qc["config_groups"].values()} == {obs}
        with safe_open(next(out.glob("*.safetensors")), "pt") as f:
            packed[obs] = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert not packed["minmax"].equal(packed["mse"])


def test_autoround_reaches_llmcompressor_and_refuses_what_it_cannot_write(tiny_llama, tmp_path, calib_txt):
    """algorithm autoround is llmcompressor's AutoRoundModifier with the recipe's iters and batch. Refused before
    anything is written: zero points (llmcompressor 0.14 writes back AutoRound's scales only) and a plan whose
    decoder layers would mix schemes (the recipe's own selection budget). One symmetric scheme throughout builds an
    artifact transformers loads, with other int4 codes than GPTQ's."""
    from safetensors import safe_open

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.layout import plan_model
    from qconv.convert.quantize import config_groups, modifiers
    from qconv.convert.sources import read_config
    from qconv.recipes.recipe import load_recipe

    ar = {"algorithm": "autoround", "actorder": None, "iters": 2, "batch_size": 2}
    sym = {"w4a16": {"weights": {"bits": 4, "symmetric": True, "strategy": "group", "group_size": 128}}}
    recipe = load_recipe(str(recipe_variant(tmp_path, "ar", quantizer=ar)))
    groups, ignore = config_groups(plan_model(tiny_llama, read_config(tiny_llama), recipe).modules, recipe)
    (mod,) = modifiers(None, recipe, groups, ignore)
    assert type(mod).__name__ == "AutoRoundModifier" and (mod.iters, mod.batch_size) == (2, 2)

    refused = (
        ({"quantizer": ar}, ["--upgrade-budget", "0"], "algorithm autoround cannot write zero points"),
        ({"quantizer": ar, "schemes": sym}, [], "algorithm autoround needs one scheme"),
    )
    for i, (over, extra, message) in enumerate(refused):
        out = tmp_path / f"refused{i}"
        r = build(
            recipe_variant(tmp_path, f"r{i}", **over),
            tiny_llama,
            out,
            "--dataset",
            calib_txt,
            *SMALL_CAL,
            *extra,
            "--no-gates",
        )
        assert r.exit_code != 0 and message in r.output and "quantizer.algorithm" in r.output, r.output
        assert not out.exists()

    codes = {}
    for name, q in (("ar", ar), ("gptq", {"algorithm": "gptq", "actorder": None})):
        out = tmp_path / name
        r = build(
            recipe_variant(tmp_path, name, quantizer=q, schemes=sym),
            tiny_llama,
            out,
            "--dataset",
            calib_txt,
            *SMALL_CAL,
            "--upgrade-budget",
            "0",
            "--no-gates",
        )
        assert r.exit_code == 0, r.output
        load_causal_lm(out)
        with safe_open(next(out.glob("*.safetensors")), "pt") as f:
            codes[name] = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
    assert not codes["ar"].equal(codes["gptq"])


@pytest.mark.slow
def test_tied_kept_awq_gptq_int4_embedding(tiny_llama, tmp_path, calib_txt, vllm_python):
    """tied_embeddings: keep + awq+gptq + act-order + mse + an int4 g32 embedding: one packed table, no lm_head
    tensor, the config tied; transformers and qconv's runtime build the head from it; the untied build is bigger by
    what the plan reports; vLLM's parser takes the config."""
    import torch

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.engine.loader import load_model
    from qconv.manifest import read_manifest

    int4_g32 = {"weights": {"bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}}
    common = dict(
        schemes={"w4a16_g32": int4_g32}, quantizer={"algorithm": "awq+gptq", "actorder": "weight", "observer": "mse"}
    )
    outs = {}
    for tie in ("keep", "untie"):
        out = outs[tie] = tmp_path / tie
        roles = {"embed": "w4a16_g32", "lm_head": "w8a16"}
        r = build(
            recipe_variant(tmp_path, tie, tied_embeddings=tie, roles=roles, **common),
            tiny_llama,
            out,
            "--dataset",
            calib_txt,
            *SMALL_CAL,
            "--no-gates",
            "--int8-budget",
            "0",
        )  # no INT8 promotion: the sizes compare
        assert r.exit_code == 0, r.output
    cfg = json.loads((outs["keep"] / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    index = json.loads((outs["keep"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index and "model.embed_tokens.weight_packed" in index
    groups = cfg["quantization_config"]["config_groups"].values()
    emb = next(g for g in groups if any("embed_tokens" in t for t in g["targets"]))
    assert (emb["weights"]["num_bits"], emb["weights"]["group_size"]) == (4, 32)
    m = read_manifest(outs["keep"])
    assert m.build.tied_embeddings is True and m.build.untie_bytes == 0
    assert any(q.vllm_feature == "quantized-tied-head" for q in m.requires)
    mu = read_manifest(outs["untie"])
    assert mu.build.untie_bytes > 0 and any("untied" in w and "bits per weight" in w for w in mu.build.warnings)
    assert mu.total_size() - m.total_size() >= 0.9 * mu.build.untie_bytes

    hf = load_causal_lm(outs["keep"], dtype="float32")
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    rt = load_model(outs["keep"], dtype=torch.float32, pack=False)
    x = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        diff = (hf(x).logits.float() - rt(x, rt.new_cache(1, x.shape[1])).float()).abs().max().item()
    assert diff < 1e-3
    from qconv.serve.vllm import ServeSource
    from qconv.serve.vllm_probe import check_quant_config

    for out in outs.values():
        check_quant_config(
            ServeSource(out, out.name, json.loads((out / "config.json").read_text()), {}, None, {}, []),
            vllm_python,
            "cpu",
        )


def test_bpw_target_sets_the_int8_budget(tiny_llama, tmp_path, calib_txt):
    from qconv.convert.layout import bpw_budget, plan_model
    from qconv.convert.sources import read_config
    from qconv.errors import QconvError
    from qconv.recipes.recipe import load_recipe

    plan = plan_model(tiny_llama, read_config(tiny_llama), load_recipe("3090"))
    base = 8 * plan.total_bytes / plan.num_parameters
    assert bpw_budget(base + 1.0, plan) == pytest.approx(plan.num_parameters / 8, abs=2)
    with pytest.raises(QconvError, match=r"below the recipe's uniform plan"):
        bpw_budget(base - 0.5, plan)
    out = tmp_path / "bpw"
    r = build("3090", tiny_llama, out, "--dataset", calib_txt, *SMALL_CAL, "--no-gates", "--bpw", f"{base + 0.5:.3f}")
    assert r.exit_code == 0, r.output
    m = json.loads((out / "qconv.json").read_text())
    sel = m["selection"]
    assert sel["budget"].endswith("bpw") and sel["int8_units"] > 0
    assert 0 < sel["spent_bytes"] <= sel["budget_bytes"]
    r = build("3090", tiny_llama, tmp_path / "x", "--bpw", "5", "--int8-budget", "1MB")
    assert r.exit_code == 2 and "--bpw and --upgrade-budget" in r.output  # --int8-budget: the same option
