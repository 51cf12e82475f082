"""Retrieval drafting: the prefix-sorted index (against a brute-force sort), candidates (longest suffix first, most
frequent first, never across a document's end, modulo aliases), the cached build from files and its errors, and
greedy decoding with a datastore == plain greedy, with fewer forwards when the corpus holds the continuation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from qconv.errors import QconvError
from qconv.runtime.datastore import Datastore, _sort_by_prefix, load_datastore, text_files
from qconv.runtime.generate import GenerationConfig, GenerationStats, generate_tokens


def test_prefix_sort_matches_a_brute_force_stable_sort():
    rng = np.random.default_rng(0)
    for width in (1, 2, 3, 8):
        keys = rng.integers(-1, 4, 300).astype(np.int32)  # few symbols: long ties, separators (-1) included
        span = 1 << (width - 1).bit_length()  # prefix doubling sorts by the next power of two: a refinement
        pad = list(keys) + [-2] * span
        want = sorted(range(len(keys)), key=lambda i: (pad[i:i + span], i))
        assert _sort_by_prefix(keys, width).tolist() == want, width


def test_candidates_longest_match_most_frequent_first_within_documents():
    docs = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 4, 6, 8], [0, 3, 4, 7], [5, 5, 1, 2]]
    ds = Datastore.build(docs, max_ngram=4, min_ngram=2)
    assert len(ds) == sum(map(len, docs))
    # suffix (2, 3, 4): continued by 5 once and 6 twice -> 6 first, following the occurrence that goes on (8)
    assert ds.candidates([0, 2, 3, 4], 3, 8) == [([6, 8], 3), ([5], 3), ([7], 2)]
    assert ds.candidates([0, 2, 3, 4], 3, 1) == [([6, 8], 3)]
    # ...then shorter suffixes add first tokens not seen yet: (3, 4) also saw 7 (above)
    assert ds.candidates([5, 1, 2], 4, 8) == [([3, 4, 5], 2)]  # "1 2" ending the last doc adds nothing
    assert ds.candidates([8, 8], 3, 8) == []  # no continuation crosses a document's end
    assert ds.candidates([4], 3, 8) == []  # below min_ngram
    aliased = Datastore.build(docs, aliases={12: 2}, max_ngram=4)
    assert aliased.candidates([12, 3, 4], 1, 8) == [([6], 3), ([5], 3), ([7], 2)]


def test_load_datastore_caches_and_rebuilds_when_files_change(tiny_llama, tmp_path):
    from qconv.runtime.loader import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "pkg" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (corpus / "notes.md").write_text("the quick brown fox jumps over the lazy dog\n")
    (corpus / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: skipped
    assert [f.name for f in text_files([corpus])] == ["notes.md", "a.py"]
    cache = tmp_path / "ds-cache"
    ds = load_datastore([corpus], tok, cache_dir=cache)
    saved = list(cache.iterdir())
    assert len(saved) == 1 and saved[0].suffix == ".npz"  # no temp file left behind
    again = load_datastore([corpus], tok, cache_dir=cache)
    assert np.array_equal(again.tokens, ds.tokens) and np.array_equal(again.order, ds.order)
    ids = tok("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]
    assert len(ids) > 6
    assert (ids[4:], 4) in ds.candidates([0] + ids[:4], len(ids) - 4, 8)  # the rest of a.py, up to its end
    (corpus / "notes.md").write_text("something else entirely\n")
    load_datastore([corpus], tok, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2  # a changed file is a new index
    with pytest.raises(QconvError, match="not found"):
        load_datastore([tmp_path / "missing"], tok, cache_dir=cache)
    (tmp_path / "empty").mkdir()
    with pytest.raises(QconvError, match="no text files"):
        load_datastore([tmp_path / "empty"], tok, cache_dir=cache)


def test_greedy_with_a_datastore_equals_plain_and_drafts_from_it(llama, monkeypatch):
    monkeypatch.setattr(llama.config, "eos_token_ids", [])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(6)]
    # Short outputs: the random model soon loops, and then prompt lookup alone predicts it.
    refs = [list(generate_tokens(llama, p, GenerationConfig(max_tokens=12))) for p in prompts]
    # A corpus that has seen these texts (other documents' noise around them): retrieval drafts the outputs.
    noise = [torch.randint(3, 300, (50,), generator=g).tolist() for _ in range(20)]
    ds = Datastore.build(noise + [p + r for p, r in zip(prompts, refs)])
    cold, warm = GenerationStats(), GenerationStats()
    for p, ref in zip(prompts, refs):
        base = GenerationConfig(max_tokens=12, spec="lookup", adaptive=False)
        assert list(generate_tokens(llama, p, base, cold)) == ref
        with_ds = GenerationConfig(max_tokens=12, spec="lookup", adaptive=False, datastore=ds)
        assert list(generate_tokens(llama, p, with_ds, warm)) == ref
        unrelated = Datastore.build(noise)  # drafts that never match: still lossless
        cfg = GenerationConfig(max_tokens=12, spec="lookup", datastore=unrelated)
        assert list(generate_tokens(llama, p, cfg)) == ref
    # With the corpus, every output is drafted whole: the prefill (first token) and one verify step per prompt.
    assert warm.forwards == 2 * len(prompts) < cold.forwards, (warm.to_dict(), cold.to_dict())


def test_cli_generate_and_bench_take_a_datastore(tiny_llama, tmp_path, monkeypatch):
    from qconv.cli import main

    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))
    (tmp_path / "corpus.txt").write_text("hello world, hello again\n" * 20)
    r = CliRunner().invoke(main, ["generate", str(tiny_llama), "--prompt", "hello world", "--max-tokens", "8",
                                  "--datastore", str(tmp_path / "corpus.txt"), "--dtype", "bfloat16", "--stats"])
    assert r.exit_code == 0, r.output
    assert list((tmp_path / "home" / "datastores").glob("*.npz"))
    r = CliRunner().invoke(main, ["generate", str(tiny_llama), "--prompt", "hi", "--datastore",
                                  str(tmp_path / "nope")])
    assert r.exit_code == 2 and "datastore path not found" in r.output
