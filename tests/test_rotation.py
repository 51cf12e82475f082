"""Issue 33: rotations. The recipe key `quantizer.rotation` reaches llm-compressor as its QuIPModifier (input
rotations on the quantized Linears only), the artifact carries compressed-tensors' transform_config, and every
reader computes what it stores: qconv's engine, transformers' load and the layer-streamed evaluation fold the
rotation into the dense weight; stock vLLM turns the input online."""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import SMALL_CAL, build, recipe_variant
from tests.test_eval_streamed import _measure, assert_same

ROTATION = {"rotation": {"type": "random-hadamard", "block_size": 64}}


@pytest.mark.parametrize(
    "rotation, expect",
    [
        ({"block_size": 48}, r"quantizer\.rotation\.block_size: must be a power of two from 2 to 8192, got 48"),
        (
            {"block_size": 2**40},
            r"quantizer\.rotation\.block_size: must be a power of two from 2 to 8192, got 1099511627776",
        ),
        ({"type": "hadamard"}, r"quantizer\.rotation\.type"),
        ({"blocks": 64}, r"quantizer\.rotation"),
        ({"roles": ["gdn_qkvz"]}, r"gdn_qkvz cannot be rotated: vLLM 0\.32 builds in_proj_qkvz with 4 output shards"),
        ({"roles": ["embed"]}, r"'embed' cannot be rotated; rotatable roles: attn_qkv"),
        ({"roles": ["mlp_down"], "algorithm": "awq+gptq"}, r"quantizer\.rotation: AWQ smoothing cannot run on rotated"),
    ],
)
def test_rotation_key_validated(tmp_path, rotation, expect):
    from qconv.recipes.recipe import load_recipe
    from qconv.recipes.schema import SchemaError

    with pytest.raises(SchemaError, match=expect):
        algorithm = rotation.pop("algorithm", "gptq")
        load_recipe(str(recipe_variant(tmp_path, "bad", quantizer={"algorithm": algorithm, "rotation": rotation})))


BUILD = ("--no-gates", "--bpw", "8.0")


@pytest.fixture(scope="module")
def rotated(tiny_models, tmp_path_factory):
    """tiny qwen3_5 (attention, Gated-DeltaNet, fused groups, MTP head) through the 3090 recipe with rotations."""
    src = tiny_models("qwen3_5_wide")  # GDN heads of 128: vLLM CPU kernels reject 32
    root = tmp_path_factory.mktemp("rotated")
    cal = root / "cal.txt"
    from tests.tiny import CORPUS

    cal.write_text(CORPUS * 20)
    recipe = recipe_variant(root, "rot", quantizer=ROTATION)
    out = root / "art"
    r = build(recipe, src, out, "--dataset", cal, *SMALL_CAL, *BUILD)
    assert r.exit_code == 0, r.output
    return src, out


def test_a_streamed_build_rotates_the_same(rotated, tmp_path):
    """compressed-tensors creates a rotation block on its Linear's offload device, "disk" in a streamed build (no
    torch device: the build failed); qconv creates it on the CPU there. The streamed artifact equals the in-memory
    one."""
    import torch

    from qconv.engine.loader import load_model

    src, out = rotated
    recipe, cal = out.parent / "rot.yaml", out.parent / "cal.txt"
    r = build(recipe, src, tmp_path / "s", "--dataset", cal, *SMALL_CAL, *BUILD, "--stream")
    assert r.exit_code == 0, r.output
    a = load_model(out, dtype=torch.float32, pack=False).state_dict()
    b = load_model(tmp_path / "s", dtype=torch.float32, pack=False).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rotation_reaches_quip_on_the_quantized_linears_only(rotated):
    """transform_config names every int4/INT8 Linear of the rotation's roles (by default all but gdn_qkvz, which
    vLLM cannot serve rotated) and nothing kept bf16 (in_proj_a/b, MTP), nor the tables."""
    from qconv.manifest import read_manifest

    _, out = rotated
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (scheme,) = qc["transform_config"]["config_groups"].values()
    assert scheme["type"] == "random-hadamard" and scheme["head_dim"] == 64
    # the calibration passes turned inputs in float32 (llm-compressor's default is float64: several times slower)
    assert scheme["precision"] == "torch.float32"
    online = [a for a in scheme["apply"] if a["location"] == "input"]
    assert len(online) == 1
    targets = {t.removeprefix("re:^").removesuffix("$").replace("\\", "") for t in online[0]["targets"]}
    m = read_manifest(out)
    quantized = {d.name for d in m.modules if d.bits and d.role not in ("embed", "lm_head", "gdn_qkvz")}
    assert targets == quantized
    assert {d.role for d in m.modules if d.name in targets} == {
        "attn_qkv",
        "attn_o",
        "mlp_gate_up",
        "mlp_down",
        "gdn_out",
    }
    assert {d.bits for d in m.modules if d.name in targets} == {4, 8}  # INT8 upgrades are rotated too
    (req,) = [r for r in m.requires if r.vllm_feature == "input-rotations-cpu"]
    assert req.platform == "cpu"  # GPUs run vLLM's transform as is; its CPU backend needs the plugin


def test_every_reader_folds_the_rotation(rotated):
    """The dense weight each reader computes with is the source's within int4 rounding; the stored weight alone (the
    rotation not folded) is nowhere near it. Our engine gives transformers' logits: fp32 dense, and bf16 with the
    int4 kernels, which turn a rotated Linear's input before the kernel (decode; prefill runs the folded weight)."""
    import torch

    from qconv.convert.dequant import _dequantized
    from qconv.convert.hfmodel import load_causal_lm
    from qconv.engine.int_linear import Int4Linear
    from qconv.engine.loader import load_model, read_safetensors

    src, out = rotated
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    base = load_causal_lm(src, dtype="float32").state_dict()
    hf = load_causal_lm(out, dtype="float32")
    stored = _dequantized(qc, read_safetensors(out), torch.float32, "", None)
    name = "model.layers.0.linear_attn.out_proj.weight"

    def rel(w):
        return ((w.float() - base[name]).norm() / base[name].norm()).item()

    assert rel(hf.state_dict()[name]) < 0.2
    assert rel(stored[name]) > 1.0

    rt = load_model(out, dtype=torch.float32, pack=False)
    bf = load_model(out, dtype=torch.bfloat16)
    int4 = [m for m in bf.modules() if isinstance(m, Int4Linear)]
    assert int4 and all(m.rotation is not None for m in int4 if m.in_features % 64 == 0)
    x = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want = hf(x).logits.float()
        diff = (want - rt(x, rt.new_cache(1, x.shape[1])).float()).abs().max().item()
        cache = bf.new_cache(1, x.shape[1])  # one token a step: every Int4Linear runs its kernel
        steps = [bf(x[:, i : i + 1], cache).float() for i in range(x.shape[1])]
        diff_bf = (want - torch.cat(steps, dim=1)).abs().max().item()
    assert diff < 1e-3 and diff_bf < 0.1, (diff, diff_bf)


def test_streamed_evaluation_folds_the_rotation(rotated, text_file, tmp_path, monkeypatch):
    src, art = rotated
    whole = _measure(art, src, text_file, False, tmp_path / "whole", monkeypatch)
    streamed = _measure(art, src, text_file, True, tmp_path / "streamed", monkeypatch)
    assert 0 < whole.weights.kld_mean < 0.5
    assert_same(whole, streamed)


def test_unreadable_transforms_are_refused(rotated, tmp_path):
    """An output-side (QuIP "u") transform cannot be folded into a dense weight the way an input one is: one clear
    error, not logits computed from weights read wrong."""
    import shutil

    from qconv.engine.loader import load_model
    from qconv.errors import QconvError

    _, out = rotated
    bad = tmp_path / "u"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (scheme,) = cfg["quantization_config"]["transform_config"]["config_groups"].values()
    scheme["apply"][0]["location"] = "output"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QconvError, match="online output transforms cannot be read by qconv"):
        load_model(bad)


def test_tensor_parallel_serving_is_refused_before_vllm_starts(rotated):
    """vLLM 0.32's transform module raises at tensor-parallel size > 1, after its start-up: qconv says so first."""
    from qconv.errors import QconvError
    from qconv.serve import vllm

    _, out = rotated
    src = vllm.load_source(out)
    vllm.check_tensor_parallel(src, 1)
    with pytest.raises(QconvError, match=r"input rotations \(transform_config\), which vLLM 0\.32 runs at tensor-para"):
        vllm.check_tensor_parallel(src, 2)


@pytest.mark.slow
def test_rotated_artifact_in_vllm(rotated, vllm_python):
    """Stock vLLM 0.32 applies the transform_config itself (a dense block matmul on CPU), with the plugin (INT8
    embedding): its greedy tokens score as our engine, which folds the rotation, scores them."""
    from tests.test_serve_vllm_plugin import TOLERANCE, served_agrees_with_native

    _, out = rotated
    assert served_agrees_with_native(out, vllm_python) <= TOLERANCE


def test_the_selection_scores_units_as_the_build_turns_them(rotated):
    """The sensitivity stage rounds each rotated unit in the rotated space, (Q(W·V))·Vᵀ, with the very block the
    build stores. On a weight with an outlier input channel (what rotations are for) that error is a fraction of
    the unrotated rounding's, which the selection would otherwise score."""
    import math

    import torch

    from qconv.calibrate.sensitivity import fake_quant
    from qconv.convert.rotation import quip_block, rotated_modules, selection_rotations, stored_rotations
    from qconv.manifest import read_manifest
    from qconv.recipes.recipe import load_recipe

    _, out = rotated
    (stored,) = stored_rotations(sorted(out.glob("*.safetensors"))).values()
    assert torch.equal(quip_block(64) * math.sqrt(64), stored.double())
    modules = read_manifest(out).modules
    recipe = load_recipe(str(out.parent / "rot.yaml"))
    blocks = selection_rotations(rotated_modules(modules, recipe), recipe)
    assert set(blocks) == {d.name for d in modules if d.bits and d.role not in ("embed", "lm_head", "gdn_qkvz")}

    m = next(d for d in modules if d.name == "model.layers.1.mlp.down_proj")
    torch.manual_seed(0)
    w = torch.randn(64, m.shape[1])
    w[:, 5] *= 30
    rotated_err = (fake_quant(w, m, rotation=blocks[m.name]) - w).norm()
    plain_err = (fake_quant(w, m) - w).norm()
    assert 0 < rotated_err < 0.5 * plain_err, (rotated_err, plain_err)
