"""`qconv plan`: the published KV arithmetic for the 27B, GDN state, fit/refusal per profile."""

import json
import shutil

import pytest
from click.testing import CliRunner

from qconv.cli import main
from qconv.kv.fit_text import profile_fit_lines, render
from qconv.kv.plan import GIB, model_dims, plan_fit
from qconv.manifest import Manifest, ModuleDecision, RecipeInfo, SourceInfo
from qconv.models.spec import ModelSpec
from qconv.recipes import load_recipe


@pytest.fixture
def artifact_27b(config_27b, tmp_path):
    """A config-only 27B 'artifact': qconv.json with a files table (15 GB of shards) and a vision module."""
    shutil.copy(config_27b / "config.json", tmp_path / "config.json")
    r = load_recipe("3090")
    Manifest(
        source=SourceInfo(kind="hf_dir", id="x"),
        recipe=RecipeInfo(r.name, r.sha256, r.to_dict()),
        modules=[
            ModuleDecision("model.visual.blocks.0.mlp.fc1", "vision", "bf16", shape=[4304, 1152]),
            ModuleDecision("mtp.layers.0.mlp.up_proj", "mtp", "bf16", shape=[17408, 5120]),
        ],
        files={
            "model-00001.safetensors": {"sha256": "0" * 64, "size": 15_000_000_000},
            "tokenizer.json": {"sha256": "0" * 64, "size": 10_000_000},
        },
    ).write(tmp_path)
    return tmp_path


def test_27b_dims_and_published_kv_arithmetic(config_27b):
    d = model_dims(ModelSpec.read(config_27b))
    assert (d.full_layers, d.kv_heads, d.head_dim, d.linear_layers) == (16, 4, 256, 48)
    assert d.conv_elems == (2 * 16 * 128 + 48 * 128) * 3 and d.recurrent_elems == 48 * 128 * 128


def test_plan_from_manifest(artifact_27b):
    r = plan_fit(artifact_27b, card="3090")
    assert r.weights.source == "manifest" and r.weights.total == 15_000_000_000
    assert r.weights.vision == 4304 * 1152 * 2 and r.weights.mtp == 17408 * 5120 * 2  # hybrid drafts with MTP
    fits = {f.name: f for f in r.profiles}
    fast, long_, huge = fits["fast"], fits["long"], fits["huge"]
    assert fast.kv_per_token == 2 * 16 * 4 * 256 * 2 == 65536
    assert long_.kv_per_token == 32768
    assert huge.kv_per_token == 16 * 4 * 210  # KVarN k4v2_g128 at D=256: 210 B/token/head
    # GDN state: fp32 recurrent for fast, fp16 for huge; one slot per draft position (4) plus the live one
    conv = 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2
    assert fast.state_bytes == conv + 48 * 48 * 128 * 128 * 4 and fast.state_slots == 5
    assert huge.state_bytes == conv + 48 * 48 * 128 * 128 * 2
    usable = int(24 * GIB * 0.92 - 1.5 * GIB) - (15_000_000_000 - r.weights.vision)
    assert fast.usable == usable
    assert all(f.fits for f in r.profiles)
    # KVarN's tokens cost 1/4.88 of bf16's, once the plugin's work memory (staging + attention, ~0.5 GiB here)
    # is set aside: one sequence gets ~4.5x longer than bf16 under the same settings
    assert huge.work_bytes > 0.4 * GIB and huge.usable == usable - huge.work_bytes and fast.work_bytes == 0
    assert 4.3 < huge.max_context["kvarn_k4v2_g128"] / huge.max_context["bf16"] < 4.6
    text = render(r)
    assert "65,536 B" in text and "32,768 B" in text and "4.88x smaller" in text
    assert "kvarn_k4v2_g256       13,056 B" in text and "kvarn_k4v4_g256       17,152 B" in text  # 204, 268 B/tok/head


def test_plan_refuses_what_does_not_fit(artifact_27b):
    res = CliRunner().invoke(main, ["plan", str(artifact_27b), "--card", "3060"])
    assert res.exit_code == 2, res.output
    assert "does not fit on RTX 3060" in res.output and "already fill the card" in res.output
    res = CliRunner().invoke(main, ["plan", str(artifact_27b), "--card-gib", "22", "--profile", "long"])
    assert res.exit_code == 2 and "long needs" in res.output and "lower context_length to at most" in res.output
    ok = CliRunner().invoke(main, ["plan", str(artifact_27b), "--card", "5090", "--profile", "huge"])
    assert ok.exit_code == 0, ok.output
    assert "profile huge" in ok.output and "profile fast" not in ok.output and "FITS" in ok.output


def test_profile_fit_lines_for_build_dry_run(config_27b):
    config = json.loads((config_27b / "config.json").read_text())
    lines = profile_fit_lines(config, load_recipe("3090"), 16_000_000_000, vision_bytes=900_000_000)
    assert len(lines) == 4 and all(" fits (vLLM" in x for x in lines)
    assert "fits (vLLM + the qconv-vllm plugin)" in lines[2]
    assert lines[2].startswith("profile huge on RTX 3090 (24 GiB): kvarn_k4v2_g128 KV at 262,144 tokens")
    assert "DOES NOT FIT" in profile_fit_lines(config, load_recipe("3090"), 22_000_000_000)[0]


def test_plan_says_a_profile_fits_only_where_a_gpu_runtime_runs_it(artifact_27b, tmp_path):
    """A KV cache that only qconv's own engine runs (on the CPU) is never reported as fitting the card."""
    import yaml

    data = load_recipe("3090").to_dict()
    data["name"] = "g256"
    data["profiles"]["huge"]["kv_cache"] = "kvarn_k4v2_g256"  # no vLLM runtime serves 256-token tiles
    path = tmp_path / "g256.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["plan", str(artifact_27b), "--recipe", str(path), "--profile", "huge"])
    assert res.exit_code == 2, res.output
    assert "runs on: no GPU runtime runs it (qconv's own engine only, on the CPU)" in res.output
    assert "NOT SERVABLE" in res.output and "kvarn_k4v2_g128" in res.output  # the fix names what a runtime serves
    ok = CliRunner().invoke(main, ["plan", str(artifact_27b), "--profile", "huge"])
    assert ok.exit_code == 0 and "runs on: vLLM + the qconv-vllm plugin" in ok.output


@pytest.mark.parametrize("args,msg", [(["--card", "gtx480"], "unknown card"), (["--profile", "x"], "unknown profile")])
def test_plan_bad_input_is_one_clear_error(artifact_27b, args, msg):
    res = CliRunner().invoke(main, ["plan", str(artifact_27b), *args])
    assert res.exit_code == 2 and msg in res.output


@pytest.mark.slow
def test_plan_estimates_weights_from_config_and_recipe(config_27b):
    """No qconv.json: weights estimated from the config + recipe via qconv.convert.layout (meta device)."""
    r = plan_fit(config_27b, card="3090", recipe="3090", profile="huge")
    assert r.weights.source == "estimate"
    assert 14 * GIB < r.weights.resident < 16 * GIB
    (huge,) = r.profiles
    assert huge.fits and huge.max_context["kvarn_k4v2_g128"] >= 262144


def test_sliding_window_layers_hold_a_window_per_sequence(tiny_models):
    """gemma3's sliding-window layers cost K/V per token only up to window - 1 + the tokens vLLM has in flight;
    the longest context the planner reports is the one whose per-sequence bytes still fit."""
    from qconv.kv.plan import VLLM_IN_FLIGHT_TOKENS

    r = plan_fit(tiny_models("gemma3"), card_gib=1.7)  # ~64 MiB left for KV
    assert (r.dims.full_layers, r.dims.sliding_layers, r.dims.sliding_window) == (1, 1, 16)
    f = r.profiles[0]
    assert f.window_kv_per_token == f.kv_per_token == 2 * 32 * 2 * 2  # K+V x kv heads x head_dim x bf16
    assert f.window_tokens == 16 - 1 + VLLM_IN_FLIGHT_TOKENS
    near, far = f.per_seq(100) - f.per_seq(99), f.per_seq(f.window_tokens + 100) - f.per_seq(f.window_tokens + 99)
    assert (near, far) == (2 * f.kv_per_token, f.kv_per_token)
    n = f.max_context[f.profile.kv_cache]
    assert 0 < n and f.per_seq(n) <= f.usable < f.per_seq(n + 1)
    assert "1 sliding-window layers (window 16)" in render(r)
