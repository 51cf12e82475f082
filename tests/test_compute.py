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
    from qconv.convert.layout import Plan

    monkeypatch.setattr(stream, "available_ram", lambda: 20 * 10**9)
    plan = Plan(family="llama", modules=[], other_bytes=0, source_bytes=6 * 10**9)  # 6 GB: 12 GB in float32
    cpu = BuildOptions(recipe="3090", model="m", out="o", device="cpu")
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": True)
    assert not use_streaming(cpu, plan)
    monkeypatch.setattr(compute, "bf16_native", lambda device="cpu": False)
    assert use_streaming(cpu, plan)
    assert not use_streaming(BuildOptions(recipe="3090", model="m", out="o", device="cpu", stream=False), plan)
