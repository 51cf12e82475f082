"""Issue 30.7: qconv's replacements of private library functions live in one table (qconv/convert/patches.py),
are checked before they are applied, fail loudly with the library's version when a target moved or changed, and
are each still called by the library they patch."""

from __future__ import annotations

import pytest

from qconv.convert import patches
from qconv.errors import QconvError
from tests.cli_helpers import FAST_CAL, build


def test_every_target_matches_the_installed_libraries():
    assert patches.check_all() == list(patches.TARGETS)


def test_a_moved_target_stops_with_the_library_version(monkeypatch):
    from importlib.metadata import version

    from llmcompressor.observers import mse_quant

    from qconv.convert.stream import row_blocked_observer

    monkeypatch.delattr(mse_quant, "_calculate_error")
    want = rf"_calculate_error no longer exists in llmcompressor {version('llmcompressor')}"
    with pytest.raises(QconvError, match=want):
        with row_blocked_observer():
            pass
    with pytest.raises(QconvError, match=want):
        patches.check_all()


def test_a_changed_signature_stops_before_anything_is_patched(monkeypatch):
    from compressed_tensors.compressors.naive_quantized import base as naive
    from compressed_tensors.compressors.pack_quantized import base as packed

    from qconv.convert.quantize import row_blocked_compression

    before = naive.quantize
    monkeypatch.setattr(packed, "pack_to_int32", lambda value, num_bits: value)
    with pytest.raises(
        QconvError,
        match=r"pack_to_int32 takes \(value, num_bits\), not \(value, num_bits, "
        r"packed_dim\) in compressed-tensors 0\.19",
    ):
        with row_blocked_compression():
            pass
    assert naive.quantize is before  # checked all first: nothing was swapped


def test_an_untested_series_stops_unless_allowed(monkeypatch):
    with pytest.raises(QconvError, match=r"llmcompressor 0\.14\.x, but llmcompressor 0\.15\.0 is installed"):
        patches.check_version("llmcompressor", "0.15.0")
    patches.check_version("llmcompressor", "0.14.9")
    monkeypatch.setenv(patches.UNTESTED_ENV, "1")
    patches.check_version("llmcompressor", "0.15.0")


def test_swap_restores_the_originals_on_error():
    from llmcompressor.pipelines.cache import IntermediatesCache

    raw = IntermediatesCache.__dict__["_onload_value"]
    with pytest.raises(RuntimeError):
        with patches.swap(onload_value=classmethod(lambda cls, intermediate: None)):
            assert IntermediatesCache.__dict__["_onload_value"] is not raw
            raise RuntimeError("boom")
    assert IntermediatesCache.__dict__["_onload_value"] is raw


@pytest.mark.slow
def test_every_patch_is_called_by_its_library(tiny_qwen3_5, tiny_llama, tmp_path, calib_txt, monkeypatch):
    """Each replacement is wrapped to count its calls; a streamed build (GPTQ, MSE observer, activations on disk,
    row-blocked compression), a tied awq+gptq build on a CPU torch, transformers loading its packed embedding and
    an AutoRound build call every one of them: none is left in place without the library reaching it."""
    import torch

    from qconv.convert.hfmodel import load_causal_lm
    from tests.cli_helpers import recipe_variant

    swapped, called = set(), set()
    swap = patches.swap

    def counting(name, fn):
        if isinstance(fn, classmethod):
            return classmethod(counting(name, fn.__func__))
        if not callable(fn):
            return fn

        def wrapper(*a, **k):
            called.add(name)
            return fn(*a, **k)

        return wrapper

    def counted_swap(**replacements):
        swapped.update(replacements)
        return swap(**{n: counting(n, fn) for n, fn in replacements.items()})

    monkeypatch.setattr(patches, "swap", counted_swap)
    r = build(
        "3090",
        tiny_qwen3_5,
        tmp_path / "streamed",
        "--dataset",
        calib_txt,
        "--work-dir",
        tmp_path / "w1",
        *FAST_CAL,
        "--stream",
    )
    assert r.exit_code == 0, r.output
    recipe = recipe_variant(
        tmp_path, "awq", quantizer={"algorithm": "awq+gptq", "rotation": None}
    )  # tied, one packed INT8 table
    r = build(recipe, tiny_llama, tmp_path / "tied", "--dataset", calib_txt, "--work-dir", tmp_path / "w2", *FAST_CAL)
    assert r.exit_code == 0, r.output
    load_causal_lm(tmp_path / "tied")
    r = build(
        "cpu", tiny_llama, tmp_path / "w8a8", "--dataset", calib_txt, "--work-dir", tmp_path / "w3", *FAST_CAL
    )  # int-quantized: compressed-tensors' naive compressor
    assert r.exit_code == 0, r.output
    recipe = recipe_variant(
        tmp_path, "ar", quantizer={"algorithm": "autoround", "actorder": None, "iters": 1, "batch_size": 2}
    )
    r = build(recipe, tiny_qwen3_5, tmp_path / "ar", "--dataset", calib_txt, "--work-dir", tmp_path / "w4", *FAST_CAL)
    assert r.exit_code == 0, r.output
    expected = set(patches.TARGETS) - ({"pin_memory"} if torch.accelerator.is_available() else set())
    assert swapped == expected
    values = {n for n, t in patches.TARGETS.items() if t.params is None}
    assert called == expected - values, expected - values - called


def test_gptq_batches_advance_the_progress_bar_without_parsing_library_logs(log_records):
    """The build's bar moves on qconv's own record from the GPTQ batch hand-over (row_blocked_gptq), not on a regex
    over llmcompressor's log text; its note names the layer."""

    import torch
    from llmcompressor.modifiers.gptq import base

    from qconv import progress
    from qconv.convert.stream import row_blocked_gptq

    lin = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    qps = [{"scale": torch.ones(32, 1), "zero_point": torch.zeros(32, 1), "global_scale": None}]
    records = log_records("qconv.convert.stream")
    with torch.no_grad(), row_blocked_gptq(names={lin: "model.layers.3.mlp.up_proj"}):
        base.prepare_batch([lin], qps, {lin: torch.eye(64)}, {lin: torch.tensor(4)})
    rec = next(r for r in records if r.name == "qconv.convert.stream" and "GPTQ" in r.getMessage())
    assert {k: v for k, v in vars(rec).items() if k in progress.advance(0)} == progress.advance(1, "layer 3")
    assert not hasattr(progress, "_QUANTIZING")
