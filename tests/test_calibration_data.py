"""Calibration sets (qconv/calibrate/data.py): self-generated text (the demo's path: no --dataset, no network), chat
`messages` rendered with the chat template, .parquet / .json / .txt files, and the errors a bad file gets."""

from __future__ import annotations

import json
import logging

import pytest

from qconv.calibrate.data import SELF_PROMPTS, load_calibration
from qconv.errors import QconvError


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _whole(tok, text: str) -> list[int]:
    """What one document becomes when the set is one window: its tokens and the eos after it."""
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_self_generated_when_no_dataset(tiny_llama, tok, caplog):
    from transformers import AutoModelForCausalLM

    loads = []

    def loader():
        loads.append(1)
        return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()

    with caplog.at_level(logging.WARNING):
        a = load_calibration(None, tok, samples=3, seq_len=24, seed=7, model_loader=loader)
    assert "SELF-GENERATED" in caplog.text and loads == [1]
    assert (a.info.kind, a.info.id, a.info.samples, a.info.seq_len) == ("self", "self-generated", 3, 24)
    assert all(0 < len(r) <= 24 for r in a.input_ids) and a.info.tokens == sum(map(len, a.input_ids))
    assert len({len(r) for r in a.input_ids}) == 1  # one length: GPTQ's calibration passes take them together
    flat = [t for r in a.input_ids for t in r]
    at = 0
    for i in range(3):  # each generated row opens with a neutral prompt in the chat template, in order
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": SELF_PROMPTS[i]}], add_generation_prompt=True, tokenize=False
        )
        want = tok(prompt, add_special_tokens=False)["input_ids"][:8]
        at = next(j for j in range(at, len(flat)) if flat[j : j + len(want)] == want) + len(want)
    b = load_calibration(None, tok, samples=3, seq_len=24, seed=7, model_loader=loader)
    assert b.input_ids == a.input_ids and b.info.sha256 == a.info.sha256  # seeded: the same set, the same hash


def test_equal_windows_keep_the_tokens_and_the_count():
    from qconv.calibrate.data import equal_windows

    rows = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]]
    assert equal_windows(rows) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # 11 tokens, 3 rows of 3: the last 2 dropped
    assert equal_windows([[1, 2], [3, 4]]) == [[1, 2], [3, 4]]  # already one length: as they are
    assert equal_windows([[1, 2, 3], [4, 5, 6, 7], [8, 9]], 2) == [[1, 2, 3, 4], [5, 6, 7, 8]]  # fewer windows


def test_grouped_attention_gives_sdpa_logits_without_repeating_the_cache(tiny_llama, tok, monkeypatch):
    """Self-generation's left-padded batches: the same logits as transformers' sdpa, and K/V never repeated to the
    query heads (transformers' sdpa repeats them whenever a padding mask is given: a copy of the cache a step)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    from qconv.calibrate.data import _grouped_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads, as in SmolLM2
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: transformers then builds a mask
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        calls = []
        real = sdpa_attention.repeat_kv
        monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(1) or real(*a))
        with _grouped_attention(model):
            assert model.config._attn_implementation == "qconv_grouped_sdpa"
            got = model(input_ids=ids, attention_mask=mask).logits
        assert calls == []
        model(input_ids=ids, attention_mask=mask)  # and after the block: transformers' own sdpa again
    assert calls and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got[0, 5:], want[0, 5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_no_dataset_and_no_model_is_a_clear_error(tok):
    with pytest.raises(QconvError, match="no calibration data"):
        load_calibration(None, tok, samples=2, seq_len=16, seed=0)


def test_chat_messages_jsonl_use_the_chat_template(tok, tmp_path):
    msgs = [
        {"role": "user", "content": "What is a lighthouse for?"},
        {"role": "assistant", "content": "It warns ships away from the rocks at night."},
    ]
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": msgs}) + "\n\n")
    s = load_calibration(str(p), tok, samples=1, seq_len=4096, seed=0)
    assert s.input_ids == [_whole(tok, tok.apply_chat_template(msgs, tokenize=False))]
    assert (s.info.kind, s.info.id) == ("file", str(p.resolve()))
    assert "<|im_start|>assistant" in tok.decode(s.input_ids[0])


def test_parquet_json_and_txt(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = "The quick brown fox jumps over the lazy dog near the river bank."
    pq.write_table(pa.table({"text": [text]}), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(
        json.dumps([{"prompt": "Q: what does a lazy dog do? ", "completion": "A: it sleeps by the river all day."}])
    )
    (tmp_path / "d.txt").write_text(text)
    assert load_calibration(str(tmp_path / "d.parquet"), tok, samples=1, seq_len=4096, seed=0).input_ids == [
        _whole(tok, text)
    ]
    assert load_calibration(str(tmp_path / "d.json"), tok, samples=1, seq_len=4096, seed=0).input_ids == [
        _whole(tok, "Q: what does a lazy dog do? A: it sleeps by the river all day.")
    ]
    assert load_calibration(str(tmp_path / "d.txt"), tok, samples=1, seq_len=4096, seed=0).input_ids == [
        _whole(tok, text)
    ]
    windows = load_calibration(str(tmp_path / "d.txt"), tok, samples=2, seq_len=4, seed=0)
    assert len(windows.input_ids) == 2 and all(len(w) == 4 for w in windows.input_ids)


@pytest.mark.parametrize(
    "name, body, match",
    [
        ("bad.parquet", None, "none of the fields messages/text/prompt/question"),
        ("bad.jsonl", "{not json\n", "cannot read calibration file"),
        ("bad.csv", "a,b\n", "unsupported calibration file type"),
        ("missing.txt", "", "calibration file not found"),
    ],
)
def test_bad_files_are_clear_errors(tok, tmp_path, name, body, match):
    p = tmp_path / name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["some text"]}), p)
    elif name != "missing.txt":
        p.write_text(body)
    with pytest.raises(QconvError, match=match):
        load_calibration(str(p), tok, samples=1, seq_len=16, seed=0)
