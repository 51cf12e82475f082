"""Issue 33: zero points (`symmetric: false`) per role: validated, carried by each decision (one role asymmetric,
the others not, in one recipe), counted in the plan's bytes, passed to llmcompressor's GPTQModifier as the config
group's own QuantizationArgs, written as compressed-tensors `weight_zero_point`, and run by vLLM on this CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.cli_helpers import SMALL_CAL, build_args, recipe_variant

ZP64 = {"weights": {"bits": 4, "symmetric": False, "strategy": "group", "group_size": 64}}


@pytest.mark.parametrize(
    "schemes, expect",
    [
        (
            {"w8a16": {"weights": {"symmetric": False}}},
            r"schemes\.w8a16\.weights\.symmetric: zero points \(symmetric: false\) are for int4 weight-only schemes",
        ),
        ({"w8a8": {"weights": {"symmetric": False}}}, r"schemes\.w8a8\.weights\.symmetric: zero points"),
        (
            {"w4a16_g64": {"weights": {"strategy": "channel", "group_size": None}}},
            r"schemes\.w4a16_g64: shares the label w4a16 with another scheme but differs in more than group_size and "
            r"symmetric",
        ),
    ],
)
def test_symmetric_validated(tmp_path, schemes, expect):
    from qconv.recipes.recipe import load_recipe
    from qconv.recipes.schema import SchemaError

    with pytest.raises(SchemaError, match=expect):
        load_recipe(str(recipe_variant(tmp_path, "bad", schemes=schemes)))


def test_zero_points_per_role_reach_gptq(tmp_path, tiny_llama):
    """The 3090 recipe's int4 roles take zero points; a variant gives mlp_down symmetric g64: two config groups that
    differ in `symmetric`, and GPTQModifier resolves them as given; the plan counts the zero points' bytes."""
    from qconv.calibrate.units import module_bytes
    from qconv.convert.groups import config_groups
    from qconv.convert.layout import layout_model
    from qconv.convert.quantize import modifiers
    from qconv.convert.sources import read_config
    from qconv.recipes.recipe import load_recipe

    sym64 = {"weights": {**ZP64["weights"], "symmetric": True}}
    recipe = load_recipe(
        str(recipe_variant(tmp_path, "zp", schemes={"w4a16_sym": sym64}, roles={"mlp_down": "w4a16_sym"}))
    )
    plan = layout_model(tiny_llama, read_config(tiny_llama), recipe)
    by_role = {m.role: m for m in plan.modules}
    down, o = by_role["mlp_down"], by_role["attn_o"]
    assert (down.scheme, down.group_size, down.symmetric) == ("w4a16", 64, True) and o.symmetric is False
    asym_down = type(down)(**{**down.__dict__, "symmetric": False})
    n, k = down.shape
    assert module_bytes(asym_down) - module_bytes(down) == n * (k // 64) // 2  # 4-bit zero point per group
    groups, ignore = config_groups(plan.modules, recipe)
    (gptq,) = modifiers(None, recipe, groups, ignore)
    resolved = gptq.resolve_quantization_config().config_groups.values()
    sym4 = [g for g in resolved if g.weights.symmetric and g.weights.num_bits == 4]
    assert len(sym4) == 1 and all("down_proj" in t for t in sym4[0].targets) and sym4[0].weights.group_size == 64
    assert any(not g.weights.symmetric and g.weights.num_bits == 4 for g in resolved)


def build_zero_point_artifact(tmp_path: Path, tiny_llama: Path, calib_txt: Path, **over) -> Path:
    from qconv.cli import main

    recipe = recipe_variant(
        tmp_path,
        "zpall",
        schemes={"w4a16": {"weights": {"symmetric": False}}, "w4a16_g64": {"weights": {"symmetric": False}}},
        **over,
    )
    out = tmp_path / "zp"
    r = CliRunner().invoke(
        main,
        [*build_args(recipe, tiny_llama, out), "--dataset", str(calib_txt), *SMALL_CAL, "--no-gates"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    return out


def test_zero_point_build_writes_zero_points(tmp_path, tiny_llama, calib_txt):
    """The artifact stores the zero points, its config says symmetric: false, the manifest records it, and our
    engine in fp32 (dequantized; bf16 runs them through the int4 kernel) matches transformers' own compressed-tensors load."""
    import torch
    from safetensors import safe_open

    from qconv.convert.hfmodel import load_causal_lm
    from qconv.engine.loader import load_model
    from qconv.manifest import read_manifest

    out = build_zero_point_artifact(tmp_path, tiny_llama, calib_txt)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    int4 = [g for g in qc["config_groups"].values() if g["weights"]["num_bits"] == 4]
    assert int4 and all(g["weights"]["symmetric"] is False for g in int4)
    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        zp = f.get_tensor("model.layers.0.mlp.down_proj.weight_zero_point")
        assert zp.dtype == torch.int32 and zp.abs().sum() > 0
    m = read_manifest(out)
    assert {d.symmetric for d in m.modules if d.bits == 4} == {False}
    hf = load_causal_lm(out, dtype="float32")
    rt = load_model(out, dtype=torch.float32, pack=False)
    x = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        diff = (hf(x).logits.float() - rt(x, rt.new_cache(1, x.shape[1])).float()).abs().max().item()
    assert diff < 1e-3


@pytest.mark.slow
def test_zero_point_artifact_in_vllm(tmp_path, tiny_llama, calib_txt, vllm_python):
    """Stock vLLM 0.32 (CPUWNA16 takes uint4 with zero points) + the plugin (INT8 tied table) serve it, and its
    greedy tokens score as our engine scores them. Built by AutoRound (the recipe's selection: INT8, g64 and g128
    units with zero points); the GPTQ-built 3090 artifact is served in tests/test_serve_vllm_plugin.py."""
    from tests.test_serve_vllm_plugin import TOLERANCE, served_agrees_with_native

    ar = {"algorithm": "autoround", "actorder": None, "iters": 4, "batch_size": 2}
    out = build_zero_point_artifact(tmp_path, tiny_llama, calib_txt, quantizer=ar)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert {(g["weights"]["num_bits"], g["weights"]["group_size"]) for g in qc} >= {(8, 128), (4, 64), (4, 128)}
    assert served_agrees_with_native(out, vllm_python) <= TOLERANCE


@pytest.mark.parametrize("bits", [4, 8])
def test_plugin_reference_kernel_dequantizes_zero_points(bits):
    """The qconv-vllm reference kernel's dequantization (plain torch) equals compressed-tensors' own decompression
    of an asymmetric pack-quantized weight: codes and zero points packed as the artifact stores them."""
    import sys

    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"))
    from qconv_vllm.packing import dequantize_rows

    torch.manual_seed(0)
    n, k, g = 48, 128, 64
    w = torch.randn(n, k) + torch.linspace(-1, 3, n)[:, None]  # rows off zero: the zero points matter
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=g)
    wg = w.view(n, k // g, g)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    sd = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    want = PackedQuantizationCompressor.decompress(dict(sd), scheme)["weight"]
    got = dequantize_rows(sd["weight_packed"], sd["weight_scale"], bits, k, torch.float32, sd["weight_zero_point"])
    assert zp.abs().sum() > 0 and torch.allclose(got, want.float(), atol=1e-6)
    assert (got - w).abs().max() <= scale.max() / 2 + 1e-5
