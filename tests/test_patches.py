"""Issue 30.7: qconv's replacements of private library functions live in one table (qconv/convert/patches.py),
are checked before they are applied, fail loudly with the library's version when a target moved or changed, and
are each still called by the library they patch."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qconv.convert import patches
from qconv.errors import QconvError
from tests.cli_helpers import FAST_CAL, build

# the plugin's patch table is read here too (its package imports no vLLM at module level), as tests/test_kvarn_*.py do
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"))


def test_every_target_matches_the_installed_libraries():
    assert patches.check_all() == list(patches.TARGETS)


def test_an_optional_librarys_target_is_checked_where_it_is_used(monkeypatch):
    """Without the gguf extra a build still starts: that target is checked when a GGUF import swaps it."""
    real = patches._version
    monkeypatch.setattr(patches, "_version", lambda package: "not installed" if package == "gguf" else real(package))
    assert patches.check_all() == [n for n, t in patches.TARGETS.items() if t.package != "gguf"]


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

    from qconv.convert.oneshot_fixes import row_blocked_compression

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
@pytest.mark.parametrize("library", ["qconv", "qconv-vllm"])
def test_every_patch_is_called_by_its_library(library, request):
    """qconv's replacements of llm-compressor / compressed-tensors / transformers, and the vLLM plugin's of vLLM."""
    if library == "qconv":
        names = ("tiny_qwen3_5", "tiny_llama", "tmp_path", "calib_txt", "smollm2_gguf")
        _qconv_patches_called(*map(request.getfixturevalue, names))
    else:
        _plugin_patches_called(*map(request.getfixturevalue, ("tiny_llama", "tmp_path", "calib_txt", "vllm_python")))


def _qconv_patches_called(tiny_qwen3_5, tiny_llama, tmp_path, calib_txt, smollm2_gguf):
    """Each replacement (and each backend qconv registers in a library's table) is wrapped to count its calls; a
    streamed build (GPTQ, MSE observer, activations on disk, row-blocked compression), a tied awq+gptq build on a CPU
    torch, transformers loading its packed embedding and an AutoRound build and a GGUF import call every one of
    them: none is left in place without the library reaching it."""
    import torch

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

    from gguf import GGUFReader, TensorNameMap

    built = {GGUFReader: 0, TensorNameMap: 0}

    def counted_init(cls):
        init = cls.__init__

        @functools.wraps(init)  # the patch table checks the target's signature
        def wrapper(self, *a, **k):
            built[cls] += 1
            init(self, *a, **k)

        return wrapper

    from qconv.convert import gptq_cpu

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(patches, "swap", counted_swap)
        mp.setattr(gptq_cpu, "block_update", counting("gptq_block_update", gptq_cpu.block_update))
        _qconv_builds(tiny_qwen3_5, tiny_llama, tmp_path, calib_txt)
        from qconv.convert.gguf import import_gguf

        for cls in built:
            mp.setattr(cls, "__init__", counted_init(cls))
        import_gguf(smollm2_gguf, tmp_path / "gguf")
    assert built == {GGUFReader: 1, TensorNameMap: 1}  # one parse, one name map (convert.gguf.one_parse)
    expected = set(patches.TARGETS) - ({"pin_memory"} if torch.accelerator.is_available() else set())
    registered = {n for n, t in patches.TARGETS.items() if t.registered}  # reached through the library's table
    assert swapped == expected - registered
    values = {n for n, t in patches.TARGETS.items() if t.params is None}
    assert called == expected - values, expected - values - called


def _qconv_builds(tiny_qwen3_5, tiny_llama, tmp_path, calib_txt):
    from qconv.convert.hfmodel import load_causal_lm
    from tests.cli_helpers import recipe_variant

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


# Run in the vLLM runtime: every plugin replacement wrapped to count its calls, then vLLM loads and generates with
# each artifact (argv[1]: [[path, LLM keyword arguments], ...]); prints what was replaced and what vLLM called.
PLUGIN_COUNT = r"""
import json, sys
from qconv_vllm import patches

called, replaced, replace = set(), set(), patches.replace


def counting(name, fn):
    if isinstance(fn, (staticmethod, classmethod)):
        return type(fn)(counting(name, fn.__func__))
    if patches.TARGETS[name].params is None and not patches.TARGETS[name].added:
        return fn  # a value (a Literal is callable too)

    def wrapper(*a, **k):
        called.add(name)
        return fn(*a, **k)

    return wrapper


def counted_replace(**new):
    replaced.update(new)
    return replace(**{n: counting(n, fn) for n, fn in new.items()})


patches.replace = counted_replace
import qconv_vllm
qconv_vllm.register()
from vllm import LLM, SamplingParams
for art, kw in json.loads(sys.argv[1]):
    llm = LLM(model=art, enforce_eager=True, max_model_len=256, max_num_seqs=2, seed=0, **kw)
    llm.generate(["alpha beta gamma delta"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    del llm
print(json.dumps({"replaced": sorted(replaced), "called": sorted(called)}))
"""


def _vllm_plugin(vllm_python: str, code: str, *args: str) -> subprocess.CompletedProcess:
    from tests.test_serve_vllm_plugin import ENV

    env = {**ENV, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "QCONV_VLLM_W4A8": "mlp"}
    return subprocess.run([vllm_python, "-c", code, *args], capture_output=True, text=True, env=env, timeout=1800)


def _plugin_patches_called(tiny_llama, tmp_path, calib_txt, vllm_python):
    """A tied llama (packed INT8 embed_tokens as its head) and a tied tiny Qwen3.5 with rotations, its MTP head
    drafting and a KVarN cache, loaded and run by vLLM on CPU: every plugin replacement is called (Marlin's input
    dtype only where Marlin runs, on a GPU)."""
    import torch

    from qconv_vllm import patches as plugin_patches
    from tests.test_serve_vllm_plugin import tiny_artifact

    r = build("3090-tied-g32", tiny_llama, tmp_path / "llama", "--dataset", calib_txt, *FAST_CAL)
    assert r.exit_code == 0, r.output
    qwen, _ = tiny_artifact(tmp_path, "qwen3_5_wide_tied", "3090-tied-g32")
    runs = [
        [str(tmp_path / "llama"), {}],
        [
            str(qwen),
            {
                "kv_cache_dtype": "kvarn_k4v2_g64",
                "block_size": 64,
                "enable_prefix_caching": False,  # KVarN keeps the first tile in fp16: it refuses prefix caching
                "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
            },
        ],
    ]
    p = _vllm_plugin(vllm_python, PLUGIN_COUNT, json.dumps(runs))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    replaced = {n for n, t in plugin_patches.TARGETS.items() if not t.relied_on}
    assert set(out["replaced"]) == replaced
    values = {n for n in replaced if plugin_patches.TARGETS[n].params is None and n != "hadamard_cpu_linear"}
    expected = replaced - values - ({"marlin_input_dtype"} if not torch.cuda.is_available() else set())
    assert set(out["called"]) == expected, expected ^ set(out["called"])


MOVED = r"""
import qconv_vllm, vllm
from vllm.model_executor.layers import vocab_parallel_embedding as e
from vllm.model_executor.models import llama
before = llama.LlamaModel.__init__
e.ParallelLMHead.tie_weights = lambda self, embed_tokens, tie_bias: None
try:
    qconv_vllm.register()
except Exception as err:
    print(type(err).__name__, err)
print("untouched" if llama.LlamaModel.__init__ is before and not qconv_vllm.applied() else "patched")
"""


@pytest.mark.slow
def test_every_plugin_target_matches_vllm_and_a_moved_one_stops_register(vllm_python):
    """All plugin targets are where the table says in the tested vLLM; one whose signature changed stops register()
    with the target, its parameters and the vLLM version, before any patch goes in."""
    p = _vllm_plugin(vllm_python, "from qconv_vllm import patches; print(len(patches.check_all(with_at_use=True)))")
    assert p.returncode == 0, p.stderr[-3000:]
    from qconv_vllm import patches as plugin_patches

    assert int(p.stdout.split()[-1]) == len(plugin_patches.TARGETS)
    p = _vllm_plugin(vllm_python, MOVED)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (
        "PatchTargetMoved qconv-vllm: vllm.model_executor.layers.vocab_parallel_embedding.ParallelLMHead.tie_weights "
        "takes (self, embed_tokens, tie_bias), not (self, embed_tokens) in vLLM 0.32" in p.stdout
    ), p.stdout
    assert p.stdout.split()[-1] == "untouched"


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
