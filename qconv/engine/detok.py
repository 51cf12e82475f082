"""Incremental detokenization, O(1) tokens decoded per step (the prefix/read-offset window vLLM and TGI use): only
the tokens since the last stable point are decoded, with a few before them so the tokenizer sees the same context
(leading-space handling, multi-token characters). Stop strings end the stream; the text before them is emitted."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Feed token ids with `push`, get the text that became final; `finish` flushes the rest. `stopped` turns true
    at the first stop string (the text before it is the last `push` returns)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max(map(len, self.stop), default=1) - 1  # a tail that could still become a stop string
        self.ids: list[int] = []
        self.prefix = self.read = 0  # decode window: ids[prefix:read] is already in `text`
        self.text = ""
        self.sent = 0  # characters of `text` already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):  # no half UTF-8 character
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def _emit(self, final: bool) -> str:
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        end = min(hits) if hits else len(self.text) - (0 if final else self.hold)
        self.stopped = bool(hits)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._emit(final=True)
