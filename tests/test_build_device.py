"""Issue 31: the build on a device. The device is a parameter from the CLI to llmcompressor's onload call; the CPU
suite runs that one path (`--device cpu`), the GPU run is bench/gpu_build.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from qconv.manifest import read_manifest
from tests.cli_helpers import CPU_COMPUTE, FAST_CAL, REPO, build, run

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def shard_bytes(art) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(art.glob("*.safetensors"))}


def test_onload_device_points_llmcompressor_pipelines_at_the_device():
    """The one patch: llmcompressor 0.14's pipelines read get_main_device(); inside onload_device they get ours,
    and the original is back afterwards."""
    from llmcompressor.pipelines.data_free import pipeline as data_free
    from llmcompressor.pipelines.sequential import pipeline as sequential

    from qconv.convert.device import onload_device

    before = sequential.get_main_device
    with onload_device("meta"):
        assert sequential.get_main_device() == torch.device("meta") == data_free.get_main_device()
    assert sequential.get_main_device is before


@pytest.mark.parametrize(
    "name, want",
    [
        ("cpu", "cpu"),
        ("auto", "cuda" if torch.cuda.is_available() else "cpu"),
        (None, "cuda" if torch.cuda.is_available() else "cpu"),
    ],
)
def test_resolve_device(name, want):
    from qconv.convert.device import resolve_device

    assert resolve_device(name) == want


@no_cuda
def test_device_cuda_without_gpu_exit_2_nothing_written(tiny_qwen3_5, tmp_path, calib_txt):
    out, work = tmp_path / "out", tmp_path / "work"
    r = build("3090", tiny_qwen3_5, out, "--dataset", calib_txt, "--work-dir", work, *FAST_CAL, "--device", "cuda")
    assert r.exit_code == 2, r.output
    assert "--device cuda but torch" in r.output and "sees no CUDA device" in r.output and "fix:" in r.output
    assert r.output.count("sees no CUDA device") == 1
    assert not out.exists() and not work.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_device_cpu_build_is_todays_build(tiny_qwen3_5, tmp_path, calib_txt, text_file, monkeypatch):
    """`--device cpu` goes through the onload call with the CLI's device (spied on), reports per-layer time, ETA
    and memory in build.log, and writes the same bytes as the build without qconv's onload device (llmcompressor
    choosing its own: the CPU here), streamed and in memory alike. Its quality report runs on that device."""
    import contextlib

    from llmcompressor.pipelines.sequential import pipeline as sequential

    from qconv.convert import device

    seen = []
    real = sequential.set_onload_device
    monkeypatch.setattr(sequential, "set_onload_device", lambda model, dev: (seen.append(dev), real(model, dev))[1])
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text('extends: "3090"\nname: tiny\nquality: {window: 64, max_tokens: 256}\n')
    args = ["--recipe", recipe, "--model", tiny_qwen3_5, "--dataset", calib_txt, *FAST_CAL, "--stream"]
    r = run(
        "build",
        *args,
        "--out",
        tmp_path / "dev",
        "--work-dir",
        tmp_path / "w1",
        "--device",
        "cpu",
        "--eval-text",
        text_file,
        "--no-gates",
    )
    assert r.exit_code == 0, r.output
    assert seen == [torch.device("cpu")]
    m = read_manifest(tmp_path / "dev")
    assert m.build.device == "cpu"
    report = json.loads((tmp_path / "dev" / "report.json").read_text())
    assert report["forward"] == {"streamed": True, "device": "cpu", "compute_dtype": CPU_COMPUTE}
    log = (tmp_path / "w1" / "build.log").read_text()
    n = json.loads((tiny_qwen3_5 / "config.json").read_text())
    n = n.get("text_config", n)["num_hidden_layers"]
    assert f"layer 1/{n}: " in log and f"layer {n}/{n}: " in log and "eta" in log and "cpu peak RSS" in log
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_build import layer_lines  # the GPU bench reads its per-phase numbers from these lines

    phases = layer_lines(tmp_path / "w1" / "build.log")
    assert [p["phase"] for p in phases] == [f"layer {i}/{n}" for i in range(1, n + 1)] + ["lm_head"]

    monkeypatch.setattr(device, "onload_device", lambda dev: contextlib.nullcontext())  # llmcompressor's own pick
    r = run("build", *args, "--out", tmp_path / "today", "--work-dir", tmp_path / "w2")
    assert r.exit_code == 0, r.output
    assert shard_bytes(tmp_path / "dev") and shard_bytes(tmp_path / "dev") == shard_bytes(tmp_path / "today")


def test_dry_run_plans_the_27b_on_a_3090(config_27b):
    """The plan for a card this machine does not have: every phase under 24 GiB at the recipe's defaults, and the
    FLOP model's projected time."""
    r = run("build", "--recipe", "3090", "--model", config_27b, "--dry-run", "--device", "cuda", "--card", "3090")
    assert r.exit_code == 0, r.output
    plan = r.output[r.output.index("device memory plan:") :]
    lines = [x for x in plan.splitlines() if "GiB  ok" in x or "DOES NOT FIT" in x]
    assert len(lines) == 5 and all("GiB  ok" in x for x in lines), r.output
    assert "device memory plan: cuda on RTX 3090, 23.00 GiB" in r.output and "128 x 2048" in r.output
    assert "projected wall time" in r.output and "64 layers x" in r.output


def test_device_budget_refuses_what_does_not_fit(config_27b):
    r = run(
        "build",
        "--recipe",
        "3090",
        "--model",
        config_27b,
        "--dry-run",
        "--device",
        "cuda",
        "--card",
        "3060",
        "--seq-len",
        "32768",
    )
    assert r.exit_code == 2 and "does not fit on RTX 3060" in r.output and "lower --seq-len" in r.output


def test_device_budget_numbers(config_27b):
    """The phases from the shapes: the 27B's widest layer holds 383 M bf16 weights and the Hessians of its
    quantized Linears (in_features^2 float32 each); the lm_head 248,320 x 5,120 bf16."""
    from qconv.build.dryrun import dry_run
    from qconv.build.memplan import budget_on
    from qconv.build.options import BuildOptions

    plan = dry_run(BuildOptions(model=str(config_27b))).plan
    dp = budget_on(plan.layout, plan.source.config, plan.recipe, device="cuda", samples=128, seq_len=2048, card="3090")
    phases = {p.name: p.parts for p in dp.phases}
    layer = phases["decoder layer: GPTQ"]
    assert layer["weights"] == 2 * (5120 * 6144 + 10240 * 5120 + 6144 * 5120 + 2 * 48 * 5120 + 3 * 17408 * 5120)
    assert layer["Hessians"] == 4 * (4 * 5120**2 + 6144**2 + 17408**2)
    assert phases["lm_head: calibration"]["weight"] == 248320 * 5120 * 2
    assert dp.block_bytes == (24 - 1) * 2**30 // 16
    # llmcompressor's `hessian += inp.matmul(inp.t())` materializes the product first: down_proj's 17,408^2 fp32
    assert phases["decoder layer: calibration"]["Hessian update"] == 4 * 17408**2  # 1.13 GiB


def test_gpu_build_bench_without_cuda_is_one_json_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu_build.py runs for real")
    p = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_build.py"), "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in json.loads(lines[0])["error"]
    assert list(tmp_path.iterdir()) == []


def test_gpu_build_has_the_27b_config_without_the_shared_folder(config_27b):
    """bench/gpu_build.py runs on a lent GPU where ../shared is absent: scale_27b falls back to the repo's copy of
    the 27B config, which must be the shared one byte for byte."""
    sys.path.insert(0, str(REPO / "bench"))
    from scale_27b import REPO_CONFIG_27B

    assert (REPO_CONFIG_27B / "config.json").read_bytes() == (config_27b / "config.json").read_bytes()


def test_layer_clock_logs_each_layer_and_the_head(caplog):
    """Each decoder layer's time, the ETA and the device's peak memory as the next layer (or the head) starts,
    positional or keyword hidden states alike; the lines carry the progress view's note marker."""
    import logging

    from qconv.convert.device import LayerClock

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
            self.lm_head = torch.nn.Linear(4, 8)

        def get_output_embeddings(self):
            return self.lm_head

    caplog.set_level(logging.INFO, logger="qconv.convert.device")
    m, x = Model(), torch.zeros(1, 4)
    clock = LayerClock(m, "cpu")
    for layer in m.model.layers:
        x = layer(layer(x))  # two batches through one layer: one tick
    m.model.layers[2](input=x)
    m.lm_head(x)
    clock.close()
    lines = [r for r in caplog.records if r.name == "qconv.convert.device"]
    assert [r.getMessage().split(":")[0] for r in lines] == ["layer 1/3", "layer 2/3", "layer 3/3", "lm_head"]
    assert "eta" in lines[0].getMessage() and "cpu peak RSS" in lines[0].getMessage()
    assert all(getattr(r, "qconv_note", False) for r in lines)
    assert not any(mod._forward_pre_hooks for mod in m.modules())  # close() removed the hooks
