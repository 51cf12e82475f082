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
    recipe = load_recipe(str(recipe_variant(tmp_path, "awq", quantizer={"algorithm": "awq+gptq", "rotation": None})))
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


def test_autoround_writes_what_it_tuned(tiny_qwen3_5, tmp_path, calib_txt, monkeypatch):
    """algorithm autoround is llmcompressor's AutoRoundModifier with the recipe's iters and batch. The 3090 recipe's
    plan through it (the built-in `3090-autoround`) (a selection mixing INT8, int4 g64 and g128 units, zero points, a separate head): the artifact
    dequantizes to the weights AutoRound tuned, unit by unit on its own grid. Without qconv's mend llmcompressor
    0.14 tunes every unit with the first config group's scheme and fails writing it back, saves zero points of 0,
    and leaves the separate head's qparams as initialized (NaN)."""
    import torch
    from safetensors import safe_open

    import qconv.convert.quantize as qz
    from qconv.convert.dequant import _dequantized
    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.layout import plan_model
    from qconv.convert.sources import read_config
    from qconv.engine.loader import read_safetensors
    from qconv.recipes.recipe import load_recipe

    recipe = tmp_path / "ar.yaml"  # the built-in 3090-autoround, with fewer steps
    recipe.write_text('extends: "3090-autoround"\nquantizer: {iters: 2, batch_size: 2}\n')
    loaded = load_recipe(str(recipe))
    groups, ignore = qz.config_groups(plan_model(tiny_qwen3_5, read_config(tiny_qwen3_5), loaded).modules, loaded)
    (mod,) = qz.modifiers(None, loaded, groups, ignore)  # the rotation comes first when given its Linears
    assert type(mod).__name__ == "AutoRoundModifier" and (mod.iters, mod.batch_size) == (2, 2)

    tuned = {}
    calibrate = qz.calibrate_embeddings

    def keep_tuned(model, **kw):  # runs right after oneshot: the weights as AutoRound left them
        calibrate(model, **kw)
        tuned.update({k: v.detach().float().clone() for k, v in model.state_dict().items() if k.endswith(".weight")})

    monkeypatch.setattr(qz, "calibrate_embeddings", keep_tuned)
    out = tmp_path / "ar"
    r = build(recipe, tiny_qwen3_5, out, "--dataset", calib_txt, *SMALL_CAL, "--no-gates", "--bpw", "7.33")
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    kinds = {(g["weights"]["num_bits"], g["weights"]["group_size"], g["weights"]["symmetric"]) for g in qc}
    assert {(8, 128, True), (4, 64, False), (4, 128, False)} <= kinds, kinds

    base = load_causal_lm(tiny_qwen3_5).state_dict()
    art = load_causal_lm(out).state_dict()
    zero_points = torch.cat(
        [
            f.get_tensor(k).flatten().float()
            for shard in out.glob("*.safetensors")
            for f in [safe_open(shard, "pt")]
            for k in f.keys()
            if k.endswith("weight_zero_point")
        ]
    )
    assert zero_points.abs().max() > 0
    quantized = [k for k in art if ".layers." in k and k.endswith("proj.weight") and "in_proj_a" not in k]
    assert quantized and not any(k.endswith("in_proj_b.weight") for k in quantized)
    # what the artifact stores, before the reader folds the recipe's input rotations back (qconv.convert.rotation):
    # the space AutoRound tuned in
    stored = _dequantized(
        json.loads((out / "config.json").read_text())["quantization_config"],
        read_safetensors(out),
        torch.float32,
        "",
        None,
    )
    for k in quantized:  # the same integers; the dequantized values differ by the scales' bf16 rounding only
        err = (stored[k].float() - tuned[k]).abs().max()
        assert err <= tuned[k].abs().max() * 2**-7, (k, err)
        assert not torch.equal(tuned[k], base[k].float()), k
    head = art["lm_head.weight"].float()
    assert torch.isfinite(head).all()
    assert (head - base["lm_head.weight"].float()).abs().max() <= base["lm_head.weight"].float().abs().max() / 100


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
        schemes={"w4a16_g32": int4_g32},
        quantizer={"algorithm": "awq+gptq", "rotation": None, "actorder": "weight", "observer": "mse"},
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
    from qconv.models import ModelSpec
    from qconv.serve.vllm import ServeSource
    from qconv.serve.vllm_probe import check_quant_config

    for out in outs.values():
        check_quant_config(
            ServeSource(out, out.name, ModelSpec.read(out), {}, None, {}, []),
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


def test_autoround_refuses_a_streamed_build_and_its_dry_run_says_so(
    tiny_qwen3_5, config_27b, tmp_path, calib_txt, monkeypatch
):
    """llmcompressor 0.14's AutoRound cannot start on a disk-offloaded model: `--stream`, or a model streaming is
    chosen for (the 27B on a host with 32 GiB free), is refused before anything is written, and the dry run says
    the same."""
    import qconv.convert.stream as stream
    from tests.cli_helpers import run

    monkeypatch.setattr(stream, "available_ram", lambda: 32 * 2**30)

    streamed = tmp_path / "streamed"
    r = build("3090-autoround", tiny_qwen3_5, streamed, "--dataset", calib_txt, *SMALL_CAL, "--no-gates", "--stream")
    assert r.exit_code == 2 and "cannot run on a streamed build" in r.output and "--stream" in r.output, r.output
    assert not streamed.exists()
    r = run("build", "--recipe", "3090-autoround", "--model", config_27b, "--dry-run")
    assert r.exit_code == 2 and "cannot run on a streamed build" in r.output, r.output
    assert "streaming was chosen" in r.output and "quantizer.algorithm" in r.output and "recipe 3090" in r.output
    assert run("build", "--recipe", "3090", "--model", config_27b, "--dry-run").exit_code == 0
