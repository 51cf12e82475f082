"""qconv.compute: bf16 weights computed in float32 where the CPU has no native bf16, and back exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from qconv import compute
from tests.cli_helpers import SMALL_CAL, run


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.register_buffer("freq", torch.linspace(0, 1, 8) / 3)  # float32, like rotary frequencies


def test_computing_in_float32_round_trips_exactly():
    torch.manual_seed(0)
    m = _Tiny()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tied = m.lin.weight
    with compute.computing_in(m, torch.float32):
        assert m.lin.weight.dtype == m.lin.bias.dtype == torch.float32
        assert m.lin.weight is tied  # the same Parameter (hooks and ties survive)
        assert torch.equal(m.lin.weight, before["lin.weight"].float())
        assert m.freq.dtype == torch.float32
    for k, v in m.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    assert compute.upcast(m, torch.bfloat16) == {}  # a half type asks for nothing


def test_compute_dtype_follows_native_bf16(monkeypatch):
    assert compute.compute_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": False)
    assert compute.compute_dtype("cpu") == torch.float32
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": True)
    assert compute.compute_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("native", [False, True])
def test_build_sensitivity_computes_in_compute_dtype_and_gptq_in_bf16(
    native, tiny_llama, tmp_path, calib_txt, monkeypatch
):
    """The sensitivity stage runs the bf16 model in float32 where bf16 is emulated (native=False), and hands GPTQ
    the model in bf16 again: the artifact's scales are bf16 either way."""
    from qconv.calibrate import sensitivity

    seen = []
    real = sensitivity.proxy_scores
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": native)
    monkeypatch.setattr(
        sensitivity, "proxy_scores", lambda model, *a: seen.append(model.lm_head.weight.dtype) or real(model, *a)
    )
    out = tmp_path / "A"
    r = run(
        "build",
        "--recipe",
        "3090",
        "--model",
        tiny_llama,
        "--out",
        out,
        "--dataset",
        calib_txt,
        *SMALL_CAL,
        "--upgrade-budget",
        "8%",
        "--no-gates",
        "--work-dir",
        tmp_path / "w",
    )
    assert r.exit_code == 0, r.output
    assert seen == [torch.bfloat16 if native else torch.float32]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        scales = {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("weight_scale")}
    assert scales == {"BF16"}


def test_in_memory_or_streamed_counts_the_compute_dtype(monkeypatch):
    """A whole-model build computes its bf16 weights in place in the compute dtype (sensitivity, self-generated
    calibration, the quality forward): on a CPU without native bf16 they take twice the bytes, so a model that fits
    in bf16 but not in float32 is streamed there."""
    from qconv.build.options import BuildOptions, use_streaming
    from qconv.convert import stream
    from qconv.convert.layout import Layout

    monkeypatch.setattr(stream, "available_ram", lambda: 20 * 10**9)
    plan = Layout(family="llama", modules=[], other_bytes=0, source_bytes=6 * 10**9)  # 6 GB: 12 GB in float32
    cpu = BuildOptions(recipe="3090", model="m", out="o", device="cpu")
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": True)
    assert not use_streaming(cpu, plan, "gptq", compute.resolve("auto", "cpu"))
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": False)
    assert use_streaming(cpu, plan, "gptq", compute.resolve("auto", "cpu"))
    off = BuildOptions(recipe="3090", model="m", out="o", device="cpu", stream=False)
    assert not use_streaming(off, plan, "gptq", compute.resolve("auto", "cpu"))


def test_compute_dtype_choice_what_stays_and_what_moves(tiny_llama, tmp_path, calib_txt):
    """`--compute-dtype float32` against `bfloat16` on one host: the artifact's format (tensor names, dtypes, shapes,
    config) and the selection's choices are the same, the weights' bytes are not (GPTQ's Hessians come from other
    activations); each records what it computed in."""
    import json

    from qconv.manifest import read_manifest

    made = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        r = run(
            "build", "--recipe", "3090", "--model", tiny_llama, "--out", out, "--dataset", calib_txt, *SMALL_CAL,
            "--upgrade-budget", "8%", "--no-gates", "--compute-dtype", dtype, "--work-dir", tmp_path / "w",
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        m = read_manifest(out)
        assert (m.build.compute_dtype, m.build.cpu_isa) == (dtype, torch.backends.cpu.get_cpu_capability())
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            layout = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
            weights = {k: f.get_tensor(k) for k in f.keys()}
        made[dtype] = (m, layout, weights, json.loads((out / "config.json").read_text()))
    (m32, lay32, w32, cfg32), (m16, lay16, w16, cfg16) = made["float32"], made["bfloat16"]
    assert lay32 == lay16 and cfg32 == cfg16
    picked = lambda m: [(u.unit, u.decision) for u in m.selection.units]  # noqa: E731
    assert picked(m32) == picked(m16) and m32.selection.spent_bytes == m16.selection.spent_bytes > 0
    assert any(not torch.equal(w32[k], w16[k]) for k in w32 if k.endswith("weight_packed"))
    assert m32.calibration.sha256 == m16.calibration.sha256  # --dataset: the same tokens either way


def test_compute_dtype_is_checked(tiny_llama, tmp_path):
    r = run("build", "--recipe", "3090", "--model", tiny_llama, "--out", tmp_path / "o", "--compute-dtype", "fp16")
    assert r.exit_code == 2 and "--compute-dtype" in r.output
    with pytest.raises(compute.QconvError, match="compute dtype"):
        compute.resolve("half")
    assert compute.resolve("auto", "cuda") == torch.bfloat16 and compute.resolve("float32", "cuda") == torch.float32


def test_cpu_isa_avx2_builds_what_an_avx2_environment_builds(tiny_qwen3_5, tmp_path, calib_txt):
    """`--cpu-isa avx2` on any x86 host gives the bytes a build gets where torch, oneDNN and MKL take their AVX2
    kernels (an AVX2-only CPU; here the same libraries told so by their environment), and records AVX2."""
    import hashlib
    import os
    import subprocess
    import sys

    from qconv.manifest import read_manifest

    made = {}
    for tag, extra, env in (("flag", ["--cpu-isa", "avx2"], {}), ("environment", [], compute.AVX2_ENV)):
        out = tmp_path / tag
        args = [
            "--dataset",
            calib_txt,
            *SMALL_CAL,
            "--upgrade-budget",
            "8%",
            "--no-gates",
            "--work-dir",
            tmp_path / f"w-{tag}",
        ]
        cmd = [sys.executable, "-m", "qconv.cli", "build", "--recipe", "3090", "--model", tiny_qwen3_5, "--out", out]
        r = subprocess.run(
            [str(c) for c in cmd + args + extra], env={**os.environ, **env}, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        m = read_manifest(out)
        assert (m.build.cpu_isa, m.build.compute_dtype) == ("AVX2", "float32")  # bf16 is emulated there: auto
        made[tag] = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))).digest()
    assert made["flag"] == made["environment"]


def test_cpu_isa_too_late_is_one_error(tiny_llama, tmp_path):
    """In a process whose torch has computed already (this one), the AVX2 kernels can no longer be chosen: one
    error that names the environment variables, unless the CPU is AVX2-only anyway."""
    import os

    before = set(os.environ)
    torch.ones(2) @ torch.ones(2)
    r = run(
        "build", "--recipe", "3090", "--model", tiny_llama, "--out", tmp_path / "o", "--cpu-isa", "avx2", "--dry-run"
    )
    if torch.backends.cpu.get_cpu_capability() == "AVX2" and not compute.bf16_native():
        assert r.exit_code == 0, r.output
    else:
        assert r.exit_code == 2 and "ATEN_CPU_CAPABILITY=avx2" in r.output, r.output
        # nothing left behind for the processes this one starts later (vLLM's CPU kernels read ONEDNN_MAX_CPU_ISA)
        assert not set(compute.AVX2_ENV) & set(os.environ) - before
