"""The vLLM command builder and its checks (no vLLM needed): flags per profile, speculation, refusal messages."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from qconv.cli import main
from qconv.errors import QconvError
from qconv.manifest import Requirement
from qconv.models import ModelSpec
from qconv.recipes.schema import from_dict
from qconv.recipes.sections import Profile, Speculative
from qconv.serve import vllm, vllm_probe


@pytest.fixture(autouse=True)
def no_runtimes(tmp_path, monkeypatch):
    """Commands are printed as they would run with no managed runtime installed (the test cache may hold one)."""
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))


def _flags(argv: list[str]) -> dict[str, str | bool]:
    """--flag value pairs (a flag followed by another flag is a boolean)."""
    out, i = {}, argv.index("--model")
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = True
            i += 1
    return out


def _print_command(args: list[str]) -> list[str]:
    r = CliRunner().invoke(main, ["serve", *args, "--backend", "vllm", "--print-command"])
    assert r.exit_code == 0, r.output
    return shlex.split(r.stdout.strip())


@pytest.mark.parametrize(
    "profile, kv, ctx, mamba",
    [
        ("fast", "auto", "65536", "float32"),
        ("long", "fp8_e4m3", "147456", "float32"),
        ("huge", "kvarn_k4v2_g128", "262144", "float16"),
    ],
)
def test_27b_print_command_per_profile(config_27b, profile, kv, ctx, mamba):
    argv = _print_command([str(config_27b), "--recipe", "3090", "--profile", profile])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    f = _flags(argv)
    assert f["--model"] == str(config_27b)
    assert f["--max-model-len"] == ctx
    assert f["--kv-cache-dtype"] == kv
    assert f["--mamba-ssm-cache-dtype"] == mamba
    assert f["--max-num-seqs"] == "1" and f["--gpu-memory-utilization"] == "0.92"
    assert f["--language-model-only"] is True and f["--no-enable-prefix-caching"] is True
    assert json.loads(f["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 4}
    assert f["--host"] == "127.0.0.1"
    assert "--tensor-parallel-size" not in f
    if profile == "huge":
        assert f["--block-size"] == "128" and "--dtype" not in f  # KVarN runs at the model's own dtype
    else:
        assert "--block-size" not in f


def test_passthrough_options(config_27b):
    argv = _print_command(
        [
            str(config_27b),
            "--recipe",
            "3090",
            "--tensor-parallel-size",
            "2",
            "--max-batch",
            "6",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--api-key",
            "sekrit",
            "--vllm-python",
            "/x/python",
        ]
    )
    f = _flags(argv)
    assert argv[0] == "/x/python"
    assert f["--tensor-parallel-size"] == "2" and f["--max-num-seqs"] == "6"
    assert f["--host"] == "0.0.0.0" and f["--port"] == "9001"
    assert "sekrit" not in argv  # the key travels in VLLM_API_KEY, never on the command line
    assert vllm.vllm_env("sekrit")["VLLM_API_KEY"] == "sekrit"


def test_tensor_parallel_size_must_divide_the_heads(tmp_path):
    """SmolLM2 has 9 attention heads: vLLM would stop its load at size 2 after minutes; qconv says so first."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": 9})
    )
    args = ["serve", str(tmp_path), "--recipe", "3090", "--backend", "vllm", "--print-command"]
    r = CliRunner().invoke(main, [*args, "--tensor-parallel-size", "2"])
    assert r.exit_code == 2 and "9 attention heads" in r.output and "1, 3, 9" in r.output, r.output
    assert CliRunner().invoke(main, [*args, "--tensor-parallel-size", "3"]).exit_code == 0
    assert CliRunner().invoke(main, [*args, "--tensor-parallel-size", "0"]).exit_code == 2


def test_cpu_ranks_get_cores_where_vllm_cannot_bind_them(monkeypatch):
    """vLLM's CPU backend binds a rank per NUMA node and stops on a host with fewer nodes than ranks: there the
    process's CPUs are split among the ranks; a binding the user set, CUDA, and size 1 are left alone."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm, "numa_nodes", lambda: 1)
    monkeypatch.setattr(vllm.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert vllm.cpu_rank_binding(2, "cpu") == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert vllm.cpu_rank_binding(1, "cpu") == {} and vllm.cpu_rank_binding(2, "cuda") == {}
    with pytest.raises(QconvError, match="needs a core per rank"):
        vllm.cpu_rank_binding(8, "cpu")
    monkeypatch.setattr(vllm, "numa_nodes", lambda: 2)
    assert vllm.cpu_rank_binding(2, "cpu") == {}  # vLLM's own binding, a node a rank
    monkeypatch.setattr(vllm, "numa_nodes", lambda: 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert vllm.cpu_rank_binding(2, "cpu") == {}


def _source(tmp_path, config: dict, spec: dict, profiles: dict | None = None) -> vllm.ServeSource:
    profiles = profiles or {"fast": Profile(kv_cache="bf16", context_length=4096, max_num_seqs=4)}
    model = ModelSpec.from_config(tmp_path, config)
    return vllm.ServeSource(tmp_path, "m", model, profiles, "fast", from_dict(Speculative, spec))


def test_speculative_mapping(tmp_path):
    dense = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    lookup = {"method": "lookup", "num_speculative_tokens": 5, "lookup": {"ngram_max": 4, "ngram_min": 2}}
    assert vllm.speculative_config(_source(tmp_path, dense, lookup)) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    # hybrid without an MTP head falls back to prompt lookup; with one it is MTP
    hybrid = {**lookup, "method": "hybrid"}
    assert vllm.speculative_config(_source(tmp_path, dense, hybrid))["method"] == "ngram"
    mtp_cfg = {"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}
    assert vllm.speculative_config(_source(tmp_path, mtp_cfg, hybrid)) == {"method": "mtp", "num_speculative_tokens": 5}
    assert vllm.speculative_config(_source(tmp_path, dense, {"method": "none"})) is None
    # the stretch: n-gram's k tokens, the lookup block after 2 fully accepted steps, by the plugin's proposer
    stretched = {"method": "hybrid", "num_speculative_tokens": 4, "lookup": {"max_block": 15, "after_saturated": 2}}
    assert vllm.speculative_config(_source(tmp_path, dense, stretched)) == {
        "method": "custom_class",
        "model": "qconv_vllm.stretch.StretchedLookup_k4_s2_n2_4",
        "num_speculative_tokens": 15,
    }
    assert vllm.speculative_config(_source(tmp_path, mtp_cfg, stretched))["method"] == "mtp"
    with pytest.raises(QconvError, match="no MTP head"):
        vllm.speculative_config(_source(tmp_path, dense, {"method": "mtp", "num_speculative_tokens": 2}))
    argv = vllm.build_command(_source(tmp_path, dense, lookup), None, vllm.LaunchOptions())
    f = _flags(argv)
    # a dense text model: no mamba/multimodal flags
    assert "--mamba-ssm-cache-dtype" not in f and "--language-model-only" not in f
    assert f["--max-num-seqs"] == "4" and f["--kv-cache-dtype"] == "auto"


def test_checks_name_the_fallback_profile(config_27b):
    src = vllm.load_source(config_27b, "3090")
    arch = src.architecture
    plain = vllm_probe.VllmInfo("0.32.0", [arch], ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
    vllm_probe.check_vllm(src, "long", plain)
    with pytest.raises(QconvError) as e:
        vllm_probe.check_vllm(src, "huge", plain)
    assert "qconv-vllm plugin" in e.value.what and "--profile fast" in e.value.fix
    with pytest.raises(QconvError, match="does not know the architecture"):
        vllm_probe.check_vllm(src, "fast", vllm_probe.VllmInfo("0.8.0", ["LlamaForCausalLM"], None))
    kvarn = vllm_probe.VllmInfo("0.22.0+kvarn", [arch], ["auto", "fp8_e4m3", "kvarn_k4v2_g128"])
    vllm_probe.check_vllm(src, "huge", kvarn)
    # stock vLLM 0.32 + the qconv-vllm plugin: the plugin's feature token adds the dtype
    plugin = vllm_probe.VllmInfo(
        "0.32.0", [arch], ["auto", "fp8_e4m3"], plugin={"version": "0.1.0", "features": ["kv-cache:kvarn_k4v2_g128"]}
    )
    vllm_probe.check_vllm(src, "huge", plugin)
    other = vllm_probe.VllmInfo(
        "0.32.0", [arch], ["auto", "fp8_e4m3"], plugin={"version": "0.1.0", "features": ["kv-cache:kvarn_k4v4_g128"]}
    )
    with pytest.raises(QconvError, match="kvarn_k4v2_g128"):
        vllm_probe.check_vllm(src, "huge", other)


def test_missing_vllm_is_a_clear_error(tmp_path):
    with pytest.raises(QconvError, match="vLLM is not usable") as e:
        vllm_probe.probe_vllm(__import__("sys").executable if not _has_vllm() else "/nonexistent/python")
    assert "--backend native" in e.value.fix


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def test_config_folder_needs_recipe_and_known_profile(config_27b):
    r = CliRunner().invoke(main, ["serve", str(config_27b), "--print-command"])
    assert r.exit_code == 2 and "--recipe" in r.output
    r = CliRunner().invoke(main, ["serve", str(config_27b), "--recipe", "3090", "--print-command", "--profile", "nope"])
    assert r.exit_code == 2 and "fast, long, huge" in r.output


def test_cpu_recipe_loads():
    from qconv.recipes import load_recipe

    r = load_recipe("cpu")
    assert not list(r.validate())
    w8a8 = r.schemes["w8a8"]
    assert w8a8.label == "w8a8" and w8a8.weights.strategy == "channel"
    assert w8a8.activations.strategy == "token" and w8a8.activations.dynamic
    assert {r.scheme_for(x) for x in ("attn_qkv", "attn_o", "mlp_gate_up", "mlp_down")} == {"w8a8"}
    assert r.scheme_for("embed") == r.scheme_for("lm_head") == "bf16"
    assert set(r.profiles) == {"fast", "long"} and r.speculative.method == "lookup"


def test_requires_refuse_until_the_vllm_feature_is_declared(config_27b):
    src = vllm.load_source(config_27b, "3090")
    plain = vllm_probe.VllmInfo("0.32.0", [src.architecture], ["auto", "fp8_e4m3"])
    src.requires = [
        Requirement.from_dict(r)
        for r in (
            {
                "feature": "int8 embed_tokens",
                "needs": "qconv runtime or a vLLM with quantized embeddings",
                "vllm_feature": "quantized-embeddings",
                "reason": "r",
            },
            {
                "feature": "profile huge: kvarn_k4v2_g128 KV cache",
                "profile": "huge",
                "needs": "qconv runtime or the KVarN build of vLLM",
                "vllm_feature": "kv-cache:kvarn_k4v2_g128",
            },
        )
    ]
    with pytest.raises(QconvError) as e:
        vllm_probe.check_vllm(src, "fast", plain)
    assert "int8 embed_tokens" in e.value.what and "--vllm-feature quantized-embeddings" in e.value.fix
    assert "--backend native" in e.value.fix
    vllm_probe.check_vllm(src, "fast", plain, ("quantized-embeddings",))  # the KV entry belongs to another profile
    # a manifest written before feature tokens existed is read by its wording
    src.requires = [
        Requirement.from_dict(
            {"feature": "int8 embed_tokens", "needs": "qconv runtime or a vLLM with quantized embeddings"}
        )
    ]
    with pytest.raises(QconvError, match="int8 embed_tokens"):
        vllm_probe.check_vllm(src, "fast", plain)
    vllm_probe.check_vllm(src, "fast", plain, ("quantized-embeddings",))
    src.requires = [Requirement("x", "qconv-runtime")]  # nothing a vLLM can declare satisfies this
    with pytest.raises(QconvError, match="needs qconv-runtime"):
        vllm_probe.check_vllm(src, "fast", plain, ("x", "qconv-runtime"))


def test_batch_profile_switches_marlin_int8_input_on_its_roles_only(config_27b, tmp_path):
    import re

    argv = _print_command([str(config_27b), "--recipe", "3090", "--profile", "batch"])
    env = dict(a.split("=", 1) for a in argv[:2])
    assert env["VLLM_MARLIN_INPUT_DTYPE"] == "int8"
    rx = re.compile(env[vllm.W4A8_ENV])
    assert rx.search("model.layers.3.mlp.gate_up_proj") and rx.search("model.layers.3.mlp.down_proj")
    assert not rx.search("model.layers.3.self_attn.qkv_proj") and not rx.search("model.layers.3.linear_attn.out_proj")
    f = _flags(argv[2:])
    assert f["--max-num-seqs"] == "12" and f["--kv-cache-dtype"] == "fp8_e4m3"
    src = vllm.load_source(config_27b, "3090")
    env, note = vllm.profile_env(src, "batch", "cpu")
    assert env == {} and "CUDA-only" in note and "W4A16" in note  # Marlin is CUDA-only: said once, not set
    assert vllm.profile_env(src, "fast", "cuda") == ({}, None)
    assert vllm.vllm_env(None, {"VLLM_MARLIN_INPUT_DTYPE": "int8"})["VLLM_MARLIN_INPUT_DTYPE"] == "int8"


def test_a_cpu_runtime_loads_multimodal_models_text_only(config_27b):
    """A profile may ask for the vision tower; on vLLM's CPU runtime (no image stack) the model is still loaded
    text only, so an image request is one 400 at vLLM's API, never a failure inside the model."""
    from dataclasses import replace

    src = vllm.load_source(config_27b, "3090")
    assert src.spec.multimodal and src.architecture in src.spec.family.multimodal_archs
    name, p = vllm.pick_profile(src, "fast")
    src.profiles = {**src.profiles, name: replace(p, language_model_only=False)}
    gpu = vllm.build_command(src, "fast", vllm.LaunchOptions(platform="cuda"))
    cpu = vllm.build_command(src, "fast", vllm.LaunchOptions(platform="cpu"))
    assert "--language-model-only" not in gpu and "--language-model-only" in cpu


def test_a_passed_quant_config_parse_is_remembered_until_vllm_changes(tmp_path, monkeypatch):
    """`qconv serve` imports vLLM once per artifact config to ask its parser (about 10 s): a passed verdict is kept
    in QCONV_HOME under the parser file's size and mtime; a refusal is asked again each time."""
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))
    root = tmp_path / "vllm"
    parser = root / vllm_probe._PARSER
    parser.parent.mkdir(parents=True)
    parser.write_text("# parser\n")
    art = tmp_path / "art"
    art.mkdir()
    qcfg = {"quant_method": "compressed-tensors", "config_groups": {}}
    (art / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    spec = SimpleNamespace(config={"quantization_config": qcfg})
    src = vllm.ServeSource(art, "art", spec, {}, None, {}, [])
    asked, verdict = [], {"ok": True}
    monkeypatch.setattr(vllm_probe, "_run_probe", lambda *a, **k: asked.append(a) or verdict)

    vllm_probe.check_quant_config(src, "py", "0.32.0", str(root))
    vllm_probe.check_quant_config(src, "py", "0.32.0", str(root))
    assert len(asked) == 1
    vllm_probe.check_quant_config(src, "py", "0.32.0")  # no package folder: nothing to key a verdict by
    assert len(asked) == 2
    parser.write_text("# parser, upgraded\n")
    vllm_probe.check_quant_config(src, "py", "0.32.0", str(root))
    assert len(asked) == 3

    verdict = {"ok": False, "error": "AssertionError", "at": "x.py:1"}
    other = {**qcfg, "format": "int-quantized"}
    spec.config = {"quantization_config": other}
    for _ in range(2):
        with pytest.raises(QconvError, match="parser rejects"):
            vllm_probe.check_quant_config(src, "py", "0.32.0", str(root))
    assert len(asked) == 5


@pytest.mark.parametrize("native", [False, True])
def test_compute_dtype_picks_vllms_dtype(tiny_llama, config_27b, monkeypatch, native):
    """--compute-dtype auto: float32 on a CPU that emulates bf16, the model's own dtype (no --dtype) on a GPU or a
    CPU with native bf16; float32 / bfloat16 as asked on any platform; a --dtype after `--` is the user's alone. A
    Gated-DeltaNet hybrid (the 27B) stays bf16 on vLLM's CPU backend, whose GDN kernel takes nothing else."""
    from qconv import compute

    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": native)

    def dtype_flags(model, platform, choice="auto", extra=()):
        src = vllm.load_source(model, "3090")
        opts = vllm.LaunchOptions(platform=platform, compute_dtype=choice, extra_args=list(extra))
        argv = vllm.build_command(src, "fast", opts)
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--dtype"]

    assert dtype_flags(tiny_llama, "cpu") == ([] if native else ["float32"])
    assert dtype_flags(tiny_llama, "cuda") == dtype_flags(tiny_llama, None) == dtype_flags(config_27b, "cpu") == []
    for platform in ("cpu", "cuda", None):
        for choice in ("bfloat16", "float32"):
            assert dtype_flags(tiny_llama, platform, choice) == [choice]
        assert dtype_flags(tiny_llama, platform, extra=["--dtype", "float16"]) == ["float16"]
    assert dtype_flags(config_27b, "cuda", "float32") == ["float32"]
    assert dtype_flags(config_27b, "cpu", "bfloat16") == ["bfloat16"]
    with pytest.raises(QconvError, match="Gated-DeltaNet layers in bf16 only"):
        dtype_flags(config_27b, "cpu", "float32")
    r = CliRunner().invoke(main, ["serve", str(config_27b), "--recipe", "3090", "--compute-dtype", "half"])
    assert r.exit_code == 2 and "--compute-dtype" in r.output


def test_float32_on_cpu_disables_vllms_bf16_only_int4_kernel(tiny_llama, monkeypatch):
    """vLLM's CPU int4 GEMM computes bf16 / fp16 only and is chosen for a float32 model all the same: wherever vLLM
    computes in float32 on a CPU (qconv's --dtype or the user's after `--`), it is named in VLLM_DISABLED_KERNELS,
    the user's entries kept, and the plugin's reference kernel runs those layers (served: test_serve_vllm_plugin's
    qwen3 parameter)."""
    src = vllm.load_source(tiny_llama, "3090")
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "MarlinLinearKernel")

    def disabled(platform, choice="auto", extra=()):
        opts = vllm.LaunchOptions(platform=platform, compute_dtype=choice, extra_args=list(extra))
        env, _ = vllm.launch_env(src, "fast", platform, 1, dtype=vllm.served_dtype(src, opts))
        return env.get("VLLM_DISABLED_KERNELS")

    both = "MarlinLinearKernel,CPUWNA16LinearKernel"
    assert disabled("cpu", "float32") == disabled("cpu", extra=["--dtype=float"]) == both
    assert disabled("cpu", "float32", ["--dtype", "bfloat16"]) is None  # the user's --dtype is what vLLM runs
    assert disabled("cpu", "bfloat16") is None and disabled("cuda", "float32") is None
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", both)
    assert disabled("cpu", "float32") == both
