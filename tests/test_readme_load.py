"""Issue 30, point 1: the README's transformers block, run as written (the artifact name replaced by a real one) on
the 3090 artifacts of SmolLM2 (tied, one INT8 table), a tiny untied Qwen3.5 and the 27B-layout fixture; and the
README's statement that transformers' own from_pretrained fails on them, checked on this transformers."""

from __future__ import annotations

import re

import pytest
import torch

from tests.cli_helpers import run
from tests.conftest import REPO
from tests.tiny import CORPUS

NAME = "my-27b-3090"


def _readme_block() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(import qconv\n.*?)```", text, re.S)[1]
    assert f'qconv.load("{NAME}")' in block
    return block


def _run_readme(artifact) -> torch.nn.Module:
    scope: dict = {}
    exec(_readme_block().replace(f'"{NAME}"', repr(str(artifact))), scope)  # noqa: S102 - the README's own code
    return scope["model"]


def _build(model, root, *extra) -> object:
    (root / "cal.txt").write_text(CORPUS * 20)
    out = root / "art"
    r = run(
        "build",
        "--recipe",
        "3090",
        "--model",
        model,
        "--out",
        out,
        "--dataset",
        root / "cal.txt",
        "--samples",
        "8",
        "--seq-len",
        "64",
        "--work-dir",
        root / "work",
        "--no-gates",
        *extra,
    )
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def qwen3_5_3090(tiny_qwen3_5, tmp_path_factory):
    return _build(tiny_qwen3_5, tmp_path_factory.mktemp("q35_3090"))


@pytest.fixture(scope="module")
def real_layout_3090(real_layout_27b, tmp_path_factory):
    return _build(real_layout_27b, tmp_path_factory.mktemp("real_3090"))


def _agrees_with_our_engine(hf, artifact) -> None:
    """The transformers model computes what qconv's engine computes from the same artifact: the README's bf16 model
    picks the same tokens up to near-ties, its documented fp32 form (`dtype="float32"`) gives the same logits."""
    import qconv
    from qconv.engine import load_model

    ours = load_model(artifact)
    toks = torch.randint(3, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(toks, ours.new_cache(1, 32)).float()
        bf16 = hf(toks, use_cache=False).logits.float()
        fp32 = qconv.load(artifact, dtype="float32")(toks, use_cache=False).logits
    assert bf16.shape == want.shape and torch.isfinite(bf16).all()
    # bf16 activations through every layer move each logit by `moved` at most; a pick of its own is then only
    # possible where our engine's margin between the two tokens is within twice that (random tokens: near-ties)
    moved = (bf16 - want).abs().amax(-1)
    theirs, mine = bf16.argmax(-1), want.argmax(-1)
    margin = (want.gather(-1, mine[..., None]) - want.gather(-1, theirs[..., None]))[..., 0]
    assert float(moved.median()) < 1.0, moved  # SmolLM2's 30 layers: 0.45 nats
    assert bool((margin <= 2 * moved).all()) and (theirs == mine).float().mean() >= 0.75, (margin, moved)
    assert (fp32 - want).abs().max() < 1e-3 * want.abs().max() + 1e-4


def _transformers_alone_fails(artifact) -> None:
    from transformers import AutoModelForCausalLM

    with pytest.raises(AttributeError, match="'Embedding' object has no attribute 'weight'"):
        AutoModelForCausalLM.from_pretrained(artifact)


@pytest.mark.slow
def test_readme_load_smollm2_3090(smollm2_3090):
    hf = _run_readme(smollm2_3090)
    assert hf.dtype == torch.bfloat16
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # the tied head is the one dequantized table
    _agrees_with_our_engine(hf, smollm2_3090)
    _transformers_alone_fails(smollm2_3090)


@pytest.mark.slow
def test_readme_load_tiny_qwen3_5_3090(qwen3_5_3090):
    import json

    assert not json.loads((qwen3_5_3090 / "config.json").read_text()).get("tie_word_embeddings")
    hf = _run_readme(qwen3_5_3090)
    assert hf.dtype == torch.bfloat16 and hf.lm_head.weight is not hf.model.embed_tokens.weight
    _agrees_with_our_engine(hf, qwen3_5_3090)
    _transformers_alone_fails(qwen3_5_3090)


@pytest.mark.slow
def test_readme_load_real_layout_3090(real_layout_3090):
    hf = _run_readme(real_layout_3090)
    assert type(hf).__name__ == "Qwen3_5ForConditionalGeneration" and hf.dtype == torch.bfloat16
    _agrees_with_our_engine(hf, real_layout_3090)
    _transformers_alone_fails(real_layout_3090)
