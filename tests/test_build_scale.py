"""Issue 4: measured INT8 selection under a budget, staged/resumable builds, reproducible weights."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qconv.manifest import read_manifest
from tests import cli_helpers
from tests.cli_helpers import FAST_CAL, build, run

REPO = Path(__file__).resolve().parents[1]


def weight_shas(art: Path) -> dict[str, str]:
    m = read_manifest(art)
    return {k: v.sha256 for k, v in m.files.items() if k.endswith(".safetensors")}


def build_args(model, out, calib, work, *extra):
    return [*cli_helpers.build_args("3090", model, out), "--dataset", calib, "--work-dir", work, *FAST_CAL, *extra]


# ---- budget parsing and selection (no weights) -------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, want",
    [("0", 0), ("1500", 1500), ("1.5GB", 1_500_000_000), ("2MiB", 2 * 2**20), ("10%", 100), ("100%", 1000)],
)
def test_parse_budget(spec, want):
    from qconv.calibrate.select import parse_budget

    assert parse_budget(spec, 1000) == want


@pytest.mark.parametrize(
    "spec, pattern", [("-5", "negative upgrade budget"), ("-1%", "negative"), ("lots", "unparseable upgrade budget")]
)
def test_bad_budget_is_a_clear_error(spec, pattern):
    from qconv.calibrate.select import parse_budget
    from qconv.errors import QconvError

    with pytest.raises(QconvError, match=pattern) as e:
        parse_budget(spec, 1000)
    assert e.value.exit_code == 2 and e.value.fix


def _units(model_dir: Path, recipe=None):
    from qconv.convert.layout import candidate_units, layout_model
    from qconv.convert.sources import read_config
    from qconv.recipes.recipe import load_recipe

    r = recipe or load_recipe("3090")
    plan = layout_model(model_dir, read_config(model_dir), r)
    return plan, candidate_units(plan, r)


def test_units_respect_fusion_and_greedy_order(tiny_qwen3_5):
    """q/k/v, gate/up and in_proj_qkv/z are one unit each; the greedy takes the best score per byte first and
    never splits a unit."""
    from qconv.calibrate.select import select
    from qconv.calibrate.sensitivity import Scores
    from qconv.convert.layout import apply_selection

    plan, units = _units(tiny_qwen3_5)
    by = {u.name: u for u in units}
    assert "layers.0.gdn_qkvz" in by and len(by["layers.0.gdn_qkvz"].base) == 2
    assert "layers.1.attn_qkv" in by and len(by["layers.1.attn_qkv"].base) == 3
    assert not any(u.name.startswith("mtp.") for u in units)  # mtp is kept bf16, never a candidate
    scores = Scores("proxy", {u.name: float(i) for i, u in enumerate(units)})
    best = max(units, key=lambda u: scores.values[u.name] / (u.top_bytes - u.base_bytes))
    sel = select(units, scores, best.top_bytes - best.base_bytes, budget="x", scheme="w8a16")
    assert sel.chosen == [best.name] and sel.spent == best.top_bytes - best.base_bytes
    mods = {m.name: m for m in apply_selection(plan, units, sel.choices)}
    assert {mods[m.name].bits for m in best.base} == {8}
    others = [m for u in units if u.name != best.name for m in u.base]
    assert {mods[m.name].bits for m in others} == {4}


def test_impossible_unit_is_a_clear_error(tiny_qwen3_5):
    """A W8A16 scheme in groups of 16: vLLM's only W8A16 kernel on Ampere with bf16 activations (Marlin) cannot run
    it, so no unit can be INT8."""
    from qconv.calibrate.select import select
    from qconv.errors import QconvError
    from qconv.recipes.recipe import load_recipe

    r = load_recipe("3090")
    r.schemes["w8a16"].weights.group_size = 16
    r.roles["gdn_ab"] = "w4a16"
    r.selection.candidates = ["gdn_ab"]
    r.selection.steps = []  # int4 with smaller groups would still be open to them
    _, units = _units(tiny_qwen3_5, r)
    assert units and all("Marlin" in u.refusal for u in units)
    with pytest.raises(QconvError, match="no candidate unit can take the selection.s scheme in vLLM") as e:
        select(units, None, 10**9, budget="1GB", scheme="w8a16")
    assert e.value.exit_code == 2
    r.selection.candidates = ["gdn_ab", "mtp"]
    r.roles["gdn_ab"] = "bf16"
    with pytest.raises(QconvError, match="kept bf16 by the recipe"):
        _units(tiny_qwen3_5, r)


def test_impossible_budget_cli_exit_2(tiny_llama, tmp_path, calib_txt):
    r = run(*build_args(tiny_llama, tmp_path / "o", calib_txt, tmp_path / "w", "--int8-budget", "-3MB"))
    assert r.exit_code == 2 and "negative upgrade budget" in r.output
    assert not (tmp_path / "o").exists()


# ---- builds on tiny models -----------------------------------------------------------------------------------


def _int8_linear_targets(art: Path) -> list[str]:
    """The config's 8-bit weight-only targets other than embed_tokens / lm_head (INT8 by the recipe itself)."""
    qc = json.loads((art / "config.json").read_text())["quantization_config"]
    return [
        t
        for g in qc["config_groups"].values()
        if g["weights"]["num_bits"] == 8 and g["format"] == "pack-quantized"
        for t in g["targets"]
        if not t.endswith(("embed_tokens$", "lm_head$"))
    ]


@pytest.mark.slow
def test_budget_zero_all_and_between(tiny_qwen3_5, tmp_path, calib_txt, caplog):
    """0 -> uniform W4 (no sensitivity stage); 1TB -> every candidate INT8; a mid budget -> the table's top units,
    recorded in qconv.json and loadable by transformers."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    from qconv.convert.hfmodel import load_causal_lm

    caplog.set_level(logging.INFO)
    work = tmp_path / "w"
    only = tmp_path / "int8-only.yaml"  # INT8 the only upgrade (selection.steps: its own tests)
    only.write_text('extends: "3090"\nselection: {steps: []}\n')
    r = run(*build_args(tiny_qwen3_5, tmp_path / "zero", calib_txt, work, "--int8-budget", "0", "--recipe", only))
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "zero")
    assert m.selection.int8_units == 0 and "sensitivity" not in m.build.stages
    assert {d.bits for d in m.modules if d.role in ("attn_qkv", "mlp_down", "gdn_qkvz")} == {4}
    assert _int8_linear_targets(tmp_path / "zero") == []

    r = run(*build_args(tiny_qwen3_5, tmp_path / "all", calib_txt, work, "--int8-budget", "1TB", "--recipe", only))
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "all")
    assert m.selection.int8_units == len(m.selection.units) > 0
    assert {d.bits for d in m.modules if d.role in m.recipe.resolved["selection"]["candidates"]} == {8}
    assert "upgrade selection" in r.output and "int8" in r.output

    units = m.selection.units
    one = min(u.extra_bytes for u in units)
    mid_budget = one * 3
    r = run(*build_args(tiny_qwen3_5, tmp_path / "mid", calib_txt, work, "--int8-budget", mid_budget, "--recipe", only))
    assert r.exit_code == 0, r.output
    assert "stage sensitivity: reusing" in caplog.text  # same source, calibration and units as the 1TB build
    m = read_manifest(tmp_path / "mid")
    sel = m.selection
    assert 0 < sel.spent_bytes <= mid_budget and 0 < sel.int8_units < len(units)
    chosen = {u.unit for u in sel.units if u.decision == "int8"}
    want, left = set(), mid_budget  # the greedy by score per extra byte, redone by hand
    for u in sorted(sel.units, key=lambda u: -u.score / u.extra_bytes):
        if u.extra_bytes <= left:
            want.add(u.unit)
            left -= u.extra_bytes
    assert chosen == want
    targets = " ".join(_int8_linear_targets(tmp_path / "mid"))
    for d in m.modules:
        if d.bits == 8 and d.role not in ("embed", "lm_head"):
            assert d.name.replace(".", "\\.") in targets
    x = torch.randint(0, 400, (1, 32), generator=torch.Generator().manual_seed(0))
    a = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32)(x).logits
    b = load_causal_lm(tmp_path / "mid", dtype="float32")(x).logits  # packed INT8 embeddings: qconv's loader
    assert ((b - a).norm() / a.norm()).item() < 0.4
    r = run(
        "build", "--recipe", only, "--model", tiny_qwen3_5, "--dry-run", "--work-dir", work, "--int8-budget", mid_budget
    )
    assert r.exit_code == 0 and "upgrade selection" in r.output, r.output
    for u in chosen:
        assert u in r.output


@pytest.mark.slow
def test_rebuild_reuses_stages_and_fresh_is_identical(tiny_llama, tmp_path, calib_txt, caplog):
    import logging

    from tests.tiny import CORPUS

    caplog.set_level(logging.INFO)
    work, held_out = tmp_path / "w", tmp_path / "held_out.txt"
    held_out.write_text(CORPUS[::-1] * 30)
    r = run(
        *build_args(
            tiny_llama, tmp_path / "A", calib_txt, work, "--int8-budget", "5%", "--eval-text", held_out, "--no-gates"
        )
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "A" / "report.json").read_text())
    assert report["artifact"] == str((tmp_path / "A").resolve())  # not the build's temp folder
    assert "# Quality report: A" in (tmp_path / "A" / "report.md").read_text()
    caplog.clear()
    r = run(
        *build_args(
            tiny_llama, tmp_path / "B", calib_txt, work, "--int8-budget", "5%", "--eval-text", held_out, "--no-gates"
        )
    )
    assert r.exit_code == 0, r.output
    for stage in ("import", "calibration", "sensitivity", "quantization", "quality"):
        assert f"stage {stage}: reusing" in caplog.text
    reused = json.loads((tmp_path / "B" / "report.json").read_text())  # a reused quality stage brings its reports
    assert reused["artifact"] == str((tmp_path / "B").resolve()) and reused["weights"] == report["weights"]
    assert read_manifest(tmp_path / "B").quality == read_manifest(tmp_path / "A").quality
    caplog.clear()
    r = run(*build_args(tiny_llama, tmp_path / "C", calib_txt, work, "--int8-budget", "5%", "--fresh"))
    assert r.exit_code == 0, r.output
    assert "reusing" not in caplog.text and "stage quantization: running" in caplog.text
    assert weight_shas(tmp_path / "A") == weight_shas(tmp_path / "B") == weight_shas(tmp_path / "C")
    m = read_manifest(tmp_path / "C")
    assert m.calibration.sha256 and m.recipe.sha256 and m.source.sha256 and m.tools["llmcompressor"]
    assert set(m.build.stages) >= {"import", "calibration", "sensitivity", "quantization"}


# The child build SIGKILLs itself the moment the quantization stage starts: right after sensitivity, with the
# stage's temp folder already made, and without racing a poll against a build that takes seconds.
_KILL_AT_QUANTIZATION = (
    "import importlib, os, signal, sys; q = importlib.import_module('qconv.convert.quantize'); "
    "q.quantize = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
    "from qconv.cli import main; sys.argv[0] = 'qconv'; main()"
)


@pytest.mark.slow
def test_sigkill_after_sensitivity_then_resume(tiny_llama, tmp_path, calib_txt):
    """A build killed (SIGKILL) right after its sensitivity stage, rerun with the same command, reuses import,
    calibration and sensitivity, sweeps the dead build's partial quantization folder and ends with the weights of
    an uninterrupted build."""
    ref = tmp_path / "ref"
    r = run(*build_args(tiny_llama, ref, calib_txt, tmp_path / "w_ref", "--int8-budget", "10%"))
    assert r.exit_code == 0, r.output
    work, out = tmp_path / "w", tmp_path / "A"
    args = [*map(str, build_args(tiny_llama, out, calib_txt, work, "--int8-budget", "10%"))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AT_QUANTIZATION, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert list(work.glob("sensitivity-*.json")), "the killed build had not finished its sensitivity stage"
    assert list(work.glob(".quantization-*.partial")), "the kill did not land inside the quantization stage"
    assert not list(work.glob("quantization-*")) and not out.exists()
    done = subprocess.run(
        [sys.executable, "-m", "qconv.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    log = done.stdout + done.stderr
    lines = {ln.split()[1]: ln for ln in log.splitlines() if ln.startswith("✓ ")}
    for stage in ("import", "calibration", "sensitivity"):
        assert "reused from the work dir" in lines[stage], log
    assert "reused" not in lines["quantization"], log
    assert not list(work.glob(".quantization-*.partial"))
    assert weight_shas(out) == weight_shas(ref)


@pytest.mark.slow
def test_streamed_build_equals_in_memory_build(tiny_qwen3_5, tmp_path, calib_txt, caplog, monkeypatch):
    """--stream keeps every weight in the source shards (disk offload) and onloads a layer at a time; the
    artifact is byte-for-byte the in-memory build's. The shard bound is lowered so that the tiny model is saved
    in several shards, as a large streamed model is (one shard in memory at a time). The 3090 plan without its
    input rotations: a streamed build stores the rotation block once per Linear (disk offload does not share it),
    the in-memory one once, so their files differ while their weights agree (tests/test_rotation.py). Both compute
    in bf16: a streamed (disk-offloaded) model runs GPTQ's calibration passes in its own dtype
    (`oneshot_fixes.calibrating_in`), so under float32 (`auto` on an AVX2-only CPU) the two differ (docs/BUILD.md)."""
    import logging

    from qconv.convert import quantize, stream
    from tests.cli_helpers import recipe_variant

    for mod in (quantize, stream):
        monkeypatch.setattr(mod, "MAX_SHARD_SIZE", "200KB")
    caplog.set_level(logging.INFO)
    norot = [
        "--recipe",
        str(recipe_variant(tmp_path, "norot", quantizer={"rotation": None})),
        "--compute-dtype",
        "bfloat16",
    ]
    r = run(*build_args(tiny_qwen3_5, tmp_path / "mem", calib_txt, tmp_path / "w1", "--no-stream", *norot))
    assert r.exit_code == 0, r.output
    r = run(*build_args(tiny_qwen3_5, tmp_path / "str", calib_txt, tmp_path / "w2", "--stream", *norot))
    assert r.exit_code == 0, r.output
    assert "streaming build" in caplog.text and read_manifest(tmp_path / "str").build.streamed is True
    assert weight_shas(tmp_path / "mem") == weight_shas(tmp_path / "str")
    assert len([k for k in weight_shas(tmp_path / "str") if k.startswith("model-0")]) > 1
    assert (tmp_path / "mem" / "config.json").read_bytes() == (tmp_path / "str" / "config.json").read_bytes()
    assert not (tmp_path / "w2" / "offload").exists()


@pytest.mark.parametrize(
    "strategy, group, actorder", [("group", 32, None), ("channel", None, None), ("group", 32, "weight")]
)
def test_row_blocked_gptq_equals_whole_matrix(strategy, group, actorder):
    """GPTQ quantizes each output row on its own against the shared Hessian: running it on blocks of rows (how a
    65,536-row lm_head stays small in memory) gives the same weights and losses, with the Hessian factorized once
    for all blocks (a dead input column and act-order included)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from llmcompressor.modifiers.gptq import base, gptq_quantize

    from qconv.convert.stream import row_blocked_gptq

    g = torch.Generator().manual_seed(0)
    rows, cols = 1000, 256
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy=strategy, group_size=group, actorder=actorder
    )
    w = torch.randn(1, rows, cols, generator=g)
    x = torch.randn(512, cols, generator=g)
    x[:, 7] = 0  # a dead input channel: GPTQ zeroes that weight column in every block
    h = (x.T @ x / 512)[None]
    wg = w.view(1, rows, cols // (group or cols), group or cols)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    kw = dict(scale=scale, zero_point=zp, global_scale=None, quant_args=args, blocksize=128, percdamp=0.01)
    whole = base.quantize_weight(weights=w.clone(), hessians=h.clone(), **kw)
    orig, block_rows, hessian_ptrs = base.quantize_weight, [], []

    @functools.wraps(orig)  # the patch table checks the target's signature: keep the original's
    def counting(weights, *a, **k):
        block_rows.append(weights.shape[1])
        hessian_ptrs.append((a[0] if a else k["hessians"]).data_ptr())
        return orig(weights, *a, **k)

    factorize, factorized = gptq_quantize.factorize_hessian, []

    @functools.wraps(factorize)
    def counting_factorize(*a):
        factorized.append(1)
        return factorize(*a)

    base.quantize_weight, gptq_quantize.factorize_hessian = counting, counting_factorize
    try:
        with row_blocked_gptq(block_bytes=4 * cols * 300):
            stacked = h.clone()
            blocked = base.quantize_weight(weights=w.clone(), hessians=stacked, **kw)
    finally:
        base.quantize_weight, gptq_quantize.factorize_hessian = orig, factorize
    assert block_rows == [300, 300, 300, 100] and len(factorized) == 1
    assert set(hessian_ptrs) == {stacked.data_ptr()}  # every block works in the stacked Hessian, no copy
    assert not blocked[0][0, :, 7].any()
    assert torch.equal(whole[0], blocked[0]) and torch.equal(whole[2], blocked[2])
    assert torch.allclose(whole[1], blocked[1], rtol=1e-5)
    # A bf16 stack (what prepare_batch gives under row_blocked_gptq): blocks go to fp32 one at a time, the result
    # is the bf16 cast of the fp32 path's result, bit for bit.
    base.quantize_weight = counting
    block_rows.clear()
    try:
        with row_blocked_gptq(block_bytes=4 * cols * 300):
            lean = base.quantize_weight(weights=w.to(torch.bfloat16), hessians=h.clone(), **kw)
    finally:
        base.quantize_weight = orig
    ref = base.quantize_weight(weights=w.to(torch.bfloat16).float(), hessians=h.clone(), **kw)
    assert block_rows == [300, 300, 300, 100] and lean[0].dtype == torch.bfloat16
    assert torch.equal(lean[0], ref[0].to(torch.bfloat16))


@pytest.mark.parametrize("actorder", [None, "weight"])
def test_batched_gptq_equals_one_module_at_a_time(actorder):
    """On the CPU a layer's same-shape modules go through GPTQ as one batch (quantize.CPU_GPTQ_BATCH): each keeps
    its own Hessian, scales and act-order, and gets the weights it gets alone, bit for bit (bf16 stacks in row
    blocks, as a build runs it)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from llmcompressor.modifiers.gptq import base

    from qconv.convert.stream import row_blocked_gptq

    g = torch.Generator().manual_seed(1)
    n, rows, cols, group = 3, 96, 128, 32
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group, actorder=actorder
    )
    w = torch.randn(n, rows, cols, generator=g).to(torch.bfloat16)
    xs = [torch.randn(256, cols, generator=g) * torch.rand(cols, generator=g) for _ in range(n)]
    h = torch.stack([x.T @ x / 256 for x in xs])
    wg = w.float().view(n, rows, cols // group, group)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    kw = dict(global_scale=None, quant_args=args, blocksize=64, percdamp=0.01)
    with row_blocked_gptq(block_bytes=4 * cols * 40):
        together = base.quantize_weight(weights=w.clone(), hessians=h.clone(), scale=scale, zero_point=zp, **kw)
        alone = [
            base.quantize_weight(
                weights=w[i : i + 1].clone(),
                hessians=h[i : i + 1].clone(),
                scale=scale[i : i + 1],
                zero_point=zp[i : i + 1],
                **kw,
            )
            for i in range(n)
        ]
    assert torch.equal(together[0], torch.cat([a[0] for a in alone]))
    assert torch.allclose(together[1], torch.cat([a[1] for a in alone]), rtol=1e-5)
    assert not torch.equal(together[0][0], together[0][1])  # three matrices, not one repeated


def test_gptq_batches_on_the_cpu_and_sizes_them_from_memory_on_a_gpu():
    from qconv.convert.quantize import CPU_GPTQ_BATCH, modifiers
    from qconv.recipes.recipe import load_recipe

    recipe = load_recipe("3090")
    (cpu,) = modifiers(None, recipe, {}, [])
    (gpu,) = modifiers(None, recipe, {}, [], device="cuda")
    assert type(cpu).__name__ == type(gpu).__name__ == "GPTQModifier"
    assert cpu.batched_quantization == CPU_GPTQ_BATCH > 1 and gpu.batched_quantization == "auto"


def test_hessian_permuted_in_place_by_row_blocks():
    import torch

    from qconv.convert.stream import _permute_in_place

    g = torch.Generator().manual_seed(0)
    h, perm = torch.randn(2, 50, 50, generator=g), torch.stack([torch.randperm(50, generator=g) for _ in range(2)])
    want = torch.stack([h[b][perm[b]][:, perm[b]] for b in range(2)])
    _permute_in_place(h, perm, block_bytes=4 * 50 * 7)
    assert torch.equal(h, want)


@pytest.mark.parametrize("modules", [1, 2])
def test_row_blocked_gptq_stacks_weights_in_their_own_dtype(modules):
    """The weights stay bf16, and the Hessians are normalized in place instead of copied twice: the same stack as
    prepare_batch's, and for one module the accumulated sum itself (no 1.2 GB copy for a 17,408-wide down_proj)."""
    import torch
    from llmcompressor.modifiers.gptq import base, helpers

    from qconv.convert.stream import row_blocked_gptq

    g = torch.Generator().manual_seed(0)
    lins = [torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(modules)]
    qps = [{"scale": torch.ones(32, 1), "zero_point": torch.zeros(32, 1), "global_scale": None} for _ in lins]
    sums = {lin: torch.randn(64, 64, generator=g) for lin in lins}
    counts = {lin: torch.tensor(7 + i) for i, lin in enumerate(lins)}
    with torch.no_grad():
        ref = base.prepare_batch(lins, qps, {k: v.clone() for k, v in sums.items()}, dict(counts))
    mine = dict(sums)
    with torch.no_grad(), row_blocked_gptq():
        out = base.prepare_batch(lins, qps, mine, dict(counts))
    assert not mine and ref[0].dtype == torch.float32 and helpers.GPTQ_PRECISION == torch.float32
    assert out[0].dtype == torch.bfloat16 and torch.equal(out[0].float(), ref[0])
    assert torch.equal(out[1], ref[1]) and all(torch.equal(a, b) for a, b in zip(out[2:4], ref[2:4]))
    if modules == 1:
        assert out[1].data_ptr() == sums[lins[0]].data_ptr()


_FRAGMENT = """
import sys
import torch
from qconv.memory import pin_mmap_threshold

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

if sys.argv[1] == "pin" and not pin_mmap_threshold():
    print(-1)
    raise SystemExit
torch.ones(30 << 18)  # a freed 30 MB block: glibc's mmap threshold rises to 30 MB unless pinned
start, keep = rss(), []
for i in range(24):  # per module: work buffers larger than the last module's, a small result kept
    a, b = torch.ones((8 + i) << 18), torch.ones((8 + i) << 18)
    keep.append(a[:1].clone())
    del a
    keep.append(torch.ones(1 << 16))
    del b
print(rss() - start)
"""


def test_pinned_mmap_threshold_returns_freed_blocks():
    """The streamed build's allocation pattern (buffers of growing size freed between small kept results) grows
    RSS by hundreds of MB under glibc's sliding mmap threshold (usually ~840 MB here, but how much the heap keeps
    varies run to run, so the default is not asserted); pinned, freed blocks go back to the system: the growth stays
    at the ~8 MB the kept results and the allocator's own state take."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    pin = int(
        subprocess.run(
            [sys.executable, "-c", _FRAGMENT, "pin"], env=env, capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    )
    if pin < 0:
        pytest.skip("no mallopt in this C library")
    assert pin < 48 << 20, pin  # the 24 freed pairs of 16-62 MB buffers alone would be ~900 MB if kept


def test_stream_refuses_tied_embeddings(tiny_llama, tmp_path, calib_txt):
    r = run(*build_args(tiny_llama, tmp_path / "o", calib_txt, tmp_path / "w", "--stream"))
    assert r.exit_code == 2 and "--stream cannot build tied embeddings" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_model_kld_from_cached_layer_inputs_matches_full_forward(tiny_models, family):
    """The model-level measure restarts at the unit's layer from cached inputs; that must equal a full forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from qconv.calibrate import sensitivity as S

    path = tiny_models(family)
    _, units = _units(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [list(range(5, 45)), list(range(50, 90))]
    with torch.no_grad():
        ref = [torch.log_softmax(model(torch.tensor([r])).logits[0], -1) for r in ids]
    u = units[-1]
    mods = dict(model.named_modules())
    for m in u.base:
        mods[m.name].weight.data.copy_(S.fake_quant(mods[m.name].weight, m))
    inputs = S._layer_inputs(model, ids)  # inputs before the unit's layer do not depend on it
    start = S._layer_index(u.base[0].name)
    assert start > 0
    full, part = S._mean_kld(model, ids, ref), S._mean_kld(model, ids, ref, start, inputs)
    assert full > 0 and abs(full - part) < 1e-6 * max(1.0, full)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_streamed_proxy_equals_in_memory_proxy(tiny_models, tmp_path, family):
    """The layer-at-a-time proxy (one layer loaded, inputs spilled to disk, the gradient pulled back layer by
    layer) gives the in-memory proxy's H, Fisher and row errors: the same scores, the same order. Windows of two
    lengths, a tied (llama) and an untied (qwen3_5) head."""
    import torch
    from transformers import AutoModelForCausalLM

    from qconv.build.streamed_sensitivity import streamed_proxy_scores
    from qconv.calibrate.sensitivity import proxy_scores

    path = tiny_models(family)
    _, units = _units(path)
    ids = [list(range(5, 45)), list(range(50, 80)), list(range(7, 47))]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    want = proxy_scores(model, units, ids)
    got = streamed_proxy_scores(path, units, ids, tmp_path)
    assert got.tokens == want.tokens == 110 and set(got.values) == set(want.values) == {u.name for u in units}
    for u in units:
        for k, e in want.errors[u.name].items():
            assert got.errors[u.name][k] == pytest.approx(e, rel=2e-2), (u.name, k)
    order = sorted(want.values, key=want.values.get)
    assert sorted(got.values, key=got.values.get) == order
    assert not list(tmp_path.iterdir())  # every spilled input is gone


def test_proxy_statistics_batched_equal_one_row_at_a_time(tiny_llama, config_27b):
    """The proxy's Hessians and Fishers from batches of equal-length rows (one forward + backward each) are the
    token-weighted sums of each row's own, in float32 up to rounding; the batches keep what a backward holds
    bounded (the 27B's 2,048-token rows go one at a time)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qconv.calibrate.sensitivity import capture_statistics, length_batches, rows_per_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    ids = [list(range(5, 45)), list(range(50, 80)), list(range(7, 47)), list(range(90, 130))]
    assert [len(b) for b in length_batches(ids, lambda n: 2)] == [2, 1, 1]
    hs, fs, tokens = capture_statistics(model, ids, names, names)
    rows = [capture_statistics(model, [r], names, names) for r in ids]
    assert tokens == sum(t for *_, t in rows) == 150
    for n in names:
        h = sum(r[0][n] * r[2] for r in rows) / tokens
        f = sum(r[1][n] * (r[2] - 1) for r in rows) / (tokens - len(ids))
        assert torch.allclose(hs[n], h, rtol=1e-4, atol=1e-6) and torch.allclose(fs[n], f, rtol=1e-3, atol=1e-12), n
    assert rows_per_batch(model.config, 40) == 16
    big = AutoConfig.for_model(**json.loads((config_27b / "config.json").read_text()))
    assert rows_per_batch(big, 2048) == 1 < rows_per_batch(big, 16)


def test_streamed_build_with_int8_budget(tiny_qwen3_5, tmp_path, calib_txt, caplog):
    """A streamed build with a budget scores its units a layer at a time and selects what the in-memory build
    selects."""
    import logging

    caplog.set_level(logging.INFO)
    extra = ("--int8-budget", "5%")
    r = run(*build_args(tiny_qwen3_5, tmp_path / "mem", calib_txt, tmp_path / "w1", "--no-stream", *extra))
    assert r.exit_code == 0, r.output
    r = run(*build_args(tiny_qwen3_5, tmp_path / "str", calib_txt, tmp_path / "w2", "--stream", *extra))
    assert r.exit_code == 0, r.output
    mem, got = read_manifest(tmp_path / "mem"), read_manifest(tmp_path / "str")
    assert got.build.streamed is True and mem.build.streamed is False
    chosen = [m.name for m in got.modules if (m.bits or 16) == 8 and m.role != "lm_head" and m.role != "embed"]
    assert chosen and chosen == [
        m.name for m in mem.modules if (m.bits or 16) == 8 and m.role not in ("lm_head", "embed")
    ]
    assert not list((tmp_path / "w2").glob("qconv-sensitivity*"))


def test_streamed_build_refuses_candidates_outside_decoder_layers(tiny_qwen3_5, tmp_path, calib_txt):
    recipe = tmp_path / "r.yaml"
    text = (REPO / "qconv" / "recipes" / "3090.yaml").read_text()
    recipe.write_text(
        text.replace("candidates: [attn_qkv,", "candidates: [lm_head, attn_qkv,").replace(
            "lm_head: w8a16", "lm_head: w4a16"
        )
    )
    r = build(
        str(recipe),
        tiny_qwen3_5,
        tmp_path / "o",
        "--dataset",
        calib_txt,
        "--work-dir",
        tmp_path / "w",
        *FAST_CAL,
        "--stream",
        "--int8-budget",
        "5%",
    )
    assert r.exit_code == 2 and "is not in a decoder layer" in r.output, r.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def test_calibration_activations_on_disk(tmp_path):
    """A streamed build's calibration activations live in files while the pipeline holds them: large tensors are
    stored as files and read back bit for bit, small ones stay in memory, and a dropped value deletes its file."""
    import gc

    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    from qconv.convert.stream import Spilled, activations_on_disk

    hidden = torch.randn(1, 64, 4096).to(torch.bfloat16)  # 512 KiB
    mask = torch.ones(1, 64, dtype=torch.long)
    with activations_on_disk(tmp_path / "act", min_bytes=256 << 10):
        cache = IntermediatesCache(offload_device="cpu")
        cache.append({"hidden_states": hidden, "attention_mask": mask, "pair": (hidden * 2, 3)})
        stored = cache.batch_intermediates[0]
        assert isinstance(stored["hidden_states"].value, Spilled)
        assert isinstance(stored["attention_mask"].value, torch.Tensor)
        assert len(list((tmp_path / "act").iterdir())) == 2
        back = cache.fetch(0)
        assert torch.equal(back["hidden_states"], hidden) and back["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(back["pair"][0], hidden * 2) and back["pair"][1] == 3
        del back
        cache.delete(0)
        gc.collect()
        assert not list((tmp_path / "act").iterdir())
    cache = IntermediatesCache(offload_device="cpu")  # outside the block: in memory again
    cache.append({"hidden_states": hidden})
    assert isinstance(cache.batch_intermediates[0]["hidden_states"].value, torch.Tensor)


@pytest.mark.parametrize(
    "fmt, bits, strategy, group",
    [
        ("int-quantized", 8, "group", 16),
        ("pack-quantized", 4, "group", 16),
        ("pack-quantized", 8, "group", 16),
        ("pack-quantized", 4, "channel", None),
    ],
)
def test_row_blocked_compression_gives_the_same_integers(fmt, bits, strategy, group):
    """Saving quantizes large matrices a block of rows at a time; the stored integers are the whole matrix's."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from qconv.convert.oneshot_fixes import row_blocked_compression

    torch.manual_seed(0)
    w = torch.randn(203, 64).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=bits, symmetric=True, strategy=strategy, group_size=group)
    g = group or 64
    scale, zp = calculate_qparams(
        w.view(203, 64 // g, g).amin(-1).float(), w.view(203, 64 // g, g).amax(-1).float(), args
    )
    sd = {"weight": w, "weight_scale": scale.view(203, -1).to(torch.bfloat16), "weight_zero_point": zp.view(203, -1)}
    comp = BaseCompressor.get_value_from_registry(fmt)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    want = comp.compress(dict(sd), scheme)
    with row_blocked_compression(block_elements=64 * 10):
        got = comp.compress(dict(sd), scheme)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.mark.parametrize("strategy, group", [("group", 16), ("channel", None)])
def test_row_blocked_mse_search_chooses_the_same_scales(strategy, group):
    """The MSE scale search, its error computed a block of rows at a time, picks the whole matrix's scales."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers.base import Observer

    from qconv.convert.stream import row_blocked_observer

    torch.manual_seed(0)
    w = (torch.randn(300, 64) * torch.linspace(0.1, 3, 64)).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy=strategy, group_size=group, observer="memoryless_mse")

    def search():
        obs = Observer.load_from_registry("memoryless_mse", base_name="weight", args=args)(w)
        return obs.min_vals, obs.max_vals

    from llmcompressor.observers import mse_quant

    original, calls = mse_quant._calculate_error, []
    mse_quant._calculate_error = functools.wraps(original)(lambda *a: calls.append(a[0].shape[1]) or original(*a))
    try:
        want = search()
        whole_calls = len(calls)
        with row_blocked_observer(block_bytes=4 * 64 * 7):  # 7 rows a block
            got = search()
    finally:
        mse_quant._calculate_error = original
    assert set(calls[:whole_calls]) == {300} and max(calls[whole_calls:]) == 7  # blocks of 7 rows were searched
    assert want[0].shape[0] == 300 and torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
