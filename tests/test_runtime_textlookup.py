"""Lookup on normalized text: Moses/wikitext spacing is undone on both sides, the continuation after the output's
suffix is re-tokenized, the copy keeps its place in the source, and no match gives no candidate."""

from __future__ import annotations

from qconv.runtime.textlookup import TextLookup, normalize


def test_normalize_undoes_moses_spacing():
    assert normalize("co @-@ stars , in 2 @,@ 000 ( the film ) .") == "co-stars, in 2,000 (the film)."


def test_candidate_continues_the_source_in_the_models_tokens(tiny_llama):
    from qconv.runtime.loader import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    source = "Repeat: the film co @-@ stars Ben Whishaw , who plays the brother of the hero ."
    prompt = tok(source, add_special_tokens=False)["input_ids"]
    m = TextLookup(tok).start(prompt)
    out = tok(" the film co-stars Ben", add_special_tokens=False)["input_ids"]  # the model's own spacing
    cands = m.candidates(prompt + out, 20)
    assert len(cands) == 1
    ids, n = cands[0]
    assert n in (32, 16, 8) and tok.decode(ids).startswith(" Whishaw, who")  # normalized, re-tokenized
    assert len(ids) == 20
    assert m.candidates(prompt, 6) == []  # no output yet
    assert m.candidates(prompt + tok(" zebra quokka", add_special_tokens=False)["input_ids"], 6) == []


def test_repeated_text_keeps_the_copys_place(tiny_llama):
    from qconv.runtime.loader import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    source = "one two three four five one two three four six"
    prompt = tok(source, add_special_tokens=False)["input_ids"]
    m = TextLookup(tok).start(prompt)
    first = m.candidates(prompt + tok("one two three four", add_special_tokens=False)["input_ids"], 8)
    assert tok.decode(first[0][0]).startswith(" five")  # the first occurrence: where a copy starts
    second = m.candidates(prompt + tok("one two three four five one two three four",
                                       add_special_tokens=False)["input_ids"], 8)
    assert tok.decode(second[0][0]).startswith(" six")  # after the first, the copy has moved on
