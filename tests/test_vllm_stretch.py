"""The plugin's stretched prompt lookup (qconv_vllm/stretch.py, vLLM's `custom_class` proposer) and its W4A8
restriction (w4a8.py): the per-row saturation streak (fast, with a stand-in for vLLM's n-gram matcher), and in real
vLLM 0.32 on this CPU (slow): the targets are where they were written against, and greedy output with the stretch
is vLLM's plain greedy output. bench/gpu_spec.py's no-GPU answer and its engine part without vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "vllm"))

from qconv_vllm import stretch  # noqa: E402


def _proposer(k=2, after=2, block=6):
    p = object.__new__(stretch.__getattr__(stretch.class_name(k, after, 1, 2)))
    p.block, p.max_model_len, p.rows = block, 1000, {}

    def match(context, n):  # the continuation of the previous occurrence of the last token
        last = context[-1]
        hits = np.nonzero(context[:-1] == last)[0]
        return context[hits[-1] + 1 : hits[-1] + 1 + n] if len(hits) else context[:0]

    p._match = match
    return p


def test_class_name_round_trips_the_shape():
    cls = stretch.__getattr__("StretchedLookup_k3_s1_n2_5")
    assert issubclass(cls, stretch.StretchedLookup)
    assert (cls.k, cls.after, cls.ngram_min, cls.ngram_max) == (3, 1, 2, 5)
    assert stretch.class_name(3, 1, 2, 5) == cls.__name__
    with pytest.raises(AttributeError):
        stretch.__getattr__("StretchedLookup_k3")


def test_streak_stretches_after_full_acceptances_and_resets():
    p = _proposer(k=2, after=2, block=6)
    text = np.array(list(range(20)) + [0], dtype=np.int32)  # copying 0..19 from the start
    toks = np.zeros((1, 100), dtype=np.int32)
    n = len(text)
    toks[0, :n] = text
    assert p.propose([[0]], np.array([n]), toks) == [[1, 2]]  # first step: k
    for step, take in enumerate(([1, 2, 3], [4, 5, 6])):  # both drafts accepted whole (+ the bonus token)
        toks[0, n : n + 3] = take
        n += 3
        out = p.propose([take], np.array([n]), toks)
        assert len(out[0]) == (2 if step == 0 else 6)  # saturated twice: the block
    toks[0, n : n + 2] = [7, 99]  # a rejection: back to k
    n += 2
    assert len(p.propose([[7, 99]], np.array([n]), toks)[0]) <= 2
    # a different request in the row (its count does not follow): the streak starts over
    p.rows[0].streak = 5
    assert len(p.propose([[1]], np.array([3]), toks)[0]) <= 2


def _vllm_run(vllm_python: str, code: str) -> dict:
    env = {
        "PYTHONPATH": f"{REPO}:{REPO / 'plugins' / 'vllm'}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
    }
    r = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_targets_are_where_the_proposer_expects_them(vllm_python):
    """Fails when vLLM's runner stops calling custom_class proposers as written, or its n-gram matcher changes."""
    out = _vllm_run(
        vllm_python,
        "import json; from qconv_vllm import stretch; stretch.check_targets(); print(json.dumps({'ok': True}))",
    )
    assert out == {"ok": True}


@pytest.mark.slow
def test_stretched_greedy_equals_plain_greedy_in_vllm(smollm2, vllm_python):
    """A text SmolLM2 goes on repeating (without a chat template it did not follow "Repeat exactly:", so nothing
    was there to accept): the stretched block is accepted past the k=2 head, and greedy output is plain greedy."""
    code = f"""
import json
from vllm import LLM, SamplingParams
prompt = "The quick brown fox jumps over the lazy dog near the river bank at dawn.\\n" * 4
res = {{}}
for name, spec in (("plain", None), ("stretched", {{"method": "custom_class", "num_speculative_tokens": 8,
                   "model": "qconv_vllm.stretch.StretchedLookup_k2_s1_n1_3"}})):
    llm = LLM(model={str(smollm2)!r}, max_model_len=512, enforce_eager=True, max_num_seqs=1, seed=0,
              speculative_config=spec, disable_log_stats=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    res[name] = list(out[0].outputs[0].token_ids)
    pos = [m.values for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")]
    res[name + "_per_pos"] = pos[0] if pos else []
    del llm
print(json.dumps(res))
"""
    out = _vllm_run(vllm_python, code)
    assert len(out["stretched"]) == 40 and out["stretched"] == out["plain"]
    per_pos = out["stretched_per_pos"]
    assert len(per_pos) == 8 and per_pos[2] > 0 and per_pos[7] > 0, per_pos  # positions past k=2: the stretch


def test_qconv_serve_names_a_class_the_plugin_has(tmp_path):
    from qconv.models import ModelSpec
    from qconv.recipes.recipe import load_recipe
    from qconv.serve import vllm

    model = ModelSpec.from_config(tmp_path, {"model_type": "llama"})
    src = vllm.ServeSource(tmp_path, "m", model, {}, "fast", load_recipe("3090").speculative)
    spec = vllm.speculative_config(src)
    module, name = spec["model"].rsplit(".", 1)
    assert module == "qconv_vllm.stretch" and issubclass(stretch.__getattr__(name), stretch.StretchedLookup)
    assert (stretch.__getattr__(name).k, spec["num_speculative_tokens"]) == (4, 15)


def test_gpu_spec_says_clearly_when_there_is_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench/gpu_spec.py would run for real")
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_spec.py")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "gpu_spec" and "no CUDA device" in out["error"]


def test_gpu_spec_engine_part_runs_without_vllm():
    """Part 2 (our engine) is what a lent GPU, where vLLM cannot be installed, measures: it must run and report
    without vLLM in the Python (this venv has none); --device cpu runs that same code here."""
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_spec.py"),
            "--device",
            "cpu",
            "--prompts",
            "1",
            "--max-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["vllm"] == "skipped: --device cpu" and "vllm_runs" not in out
    for name in ("mtp", "mtp_stretched"):
        assert out["engine"][name]["identical_to_plain"] is True and out["engine"][name]["tokens_per_step"] >= 1


def test_w4a8_restriction_keeps_int8_input_to_the_named_modules():
    from qconv_vllm import w4a8

    pick = w4a8.restricted(lambda prefix=None: "int8", r"\.mlp\.(gate_up|down)_proj$")
    assert pick("model.layers.0.mlp.down_proj") == "int8" and pick("model.layers.0.mlp.gate_up_proj") == "int8"
    assert pick("model.layers.0.self_attn.qkv_proj") is None and pick(None) is None


@pytest.mark.slow
def test_w4a8_patch_target_in_vllm(vllm_python):
    """Fails when vLLM's WNA16 scheme stops choosing Marlin's input dtype through get_marlin_input_dtype."""
    code = (
        "import json, os; os.environ['QCONV_VLLM_W4A8'] = 'mlp'; from qconv_vllm import w4a8; "
        "names = w4a8.apply(); from qconv_vllm import patches; f = patches.current('marlin_input_dtype'); "
        "print(json.dumps({'names': names, 'attn': repr(f('model.layers.0.self_attn.qkv_proj'))}))"
    )
    out = _vllm_run(vllm_python, code)
    assert out["names"] and out["attn"] == "None"
