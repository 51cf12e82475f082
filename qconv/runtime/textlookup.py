"""Prompt lookup on detokenized, normalized text: a second opinion for token trees when a model copies a document
but writes it in other tokens than the source's. Wikitext and other Moses-tokenized text spaces its punctuation
("co @-@ stars", "film , television", "( 2004 )") and a model copying it writes "co-stars", "film, television";
a word can also tokenize differently after a changed neighbour (`" Citizenship "` vs `"Citizenship"`). Token
n-grams stop matching there, while the text, normalized on both sides, still lines up. The continuation is
re-tokenized and offered as a candidate; the target verifies it like any other draft (lossless)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Moses / wikitext detokenization: " @-@ " -> "-", no space before closing or after opening punctuation.
DETOKENIZE_RULES = ((re.compile(r" @(.)@ "), r"\1"), (re.compile(r" ([,.;:!?)\]}%])"), r"\1"),
                    (re.compile(r"([(\[{$]) "), r"\1"))
SUFFIX_CHARS = (32, 16, 8)  # output suffixes tried, longest first
CONTINUATION_CHARS = 120  # text re-tokenized per candidate (more than max_block tokens of prose)
TAIL_TOKENS = 48  # output tokens decoded per step (enough for the longest suffix)


def normalize(text: str) -> str:
    for pattern, repl in DETOKENIZE_RULES:
        text = pattern.sub(repl, text)
    return text


@dataclass
class TextLookup:
    """Per-model settings (the tokenizer); `start` makes the per-request matcher."""

    tokenizer: object

    def start(self, prompt: list[int]) -> TextMatcher:
        return TextMatcher(self.tokenizer, normalize(self.tokenizer.decode(prompt)), len(prompt))


@dataclass
class TextMatcher:
    tokenizer: object
    source: str  # the normalized prompt text
    prompt_len: int
    cursor: int = field(default=0)  # where the last match continued in `source`

    def candidates(self, seq: list[int], k: int) -> list[tuple[list[int], int]]:
        """At most one continuation (k tokens, with the matched suffix length in characters)."""
        out = seq[max(self.prompt_len, len(seq) - TAIL_TOKENS):]
        if not out or k <= 0:
            return []
        text = normalize(self.tokenizer.decode(out))
        for n in SUFFIX_CHARS:
            if len(text) < n:
                continue
            q = text[-n:]
            # The occurrence nearest to where the last match continued (a copy keeps its place in the source).
            after = self.source.find(q, max(self.cursor - n, 0))
            before = self.source.rfind(q, 0, max(self.cursor, n))
            found = [x for x in (after, before) if x >= 0]
            if found:
                e = min(found, key=lambda x: abs(x + n - self.cursor))
                self.cursor = e + n
                cont = self.source[e + n:e + n + CONTINUATION_CHARS]
                ids = self.tokenizer(cont, add_special_tokens=False)["input_ids"][:k] if cont else []
                return [(list(ids), n)] if ids else []
        return []
