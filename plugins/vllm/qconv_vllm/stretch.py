"""Prompt lookup stretched after saturation, as a vLLM `custom_class` proposer (speculative method custom_class,
model "qconv_vllm.stretch.StretchedLookup"): each request drafts `k` tokens by vLLM's own n-gram match, and once
its whole proposal was accepted `after_saturated` steps running, up to `num_speculative_tokens` (the block). The
proposer only proposes tokens; verification stays vLLM's, so greedy output is vLLM's plain greedy output.

vLLM 0.32's custom_class hook is token-only and experimental: `GPUModelRunner` (which the CPU runner extends) calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)` and gets one list of draft ids
per batch row. It sees no request ids, so a row's streak continues only while its token count advances by exactly
what was sampled for it (a new request in the row starts over). The hook passes only VllmConfig, so the shape (k,
after_saturated, n-gram range) is in the class name vLLM imports: StretchedLookup_k4_s2_n2_4 (class_name()).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def check_targets() -> None:
    """Raise, naming the vLLM version, if the runner's custom_class call or vLLM's n-gram matcher moved (the
    plugin's patch table holds both)."""
    from qconv_vllm import patches

    patches.current("runner_propose")
    patches.current("ngram_match")


@dataclass
class Row:
    tokens: int  # the row's token count when it was last proposed for
    proposed: int  # tokens proposed then
    streak: int  # steps running whose proposal (its first k tokens) was accepted whole


def class_name(k: int, after_saturated: int, ngram_min: int, ngram_max: int) -> str:
    """The proposer class for one shape, as vLLM's speculative config names it (`model`)."""
    return f"StretchedLookup_k{k}_s{after_saturated}_n{ngram_min}_{ngram_max}"


_NAME = re.compile(r"StretchedLookup_k(\d+)_s(\d+)_n(\d+)_(\d+)")


def __getattr__(name: str):
    """StretchedLookup_k4_s2_n2_4 -> StretchedLookup with that shape (vLLM imports the class by name)."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise AttributeError(name)
    k, after, lo, hi = map(int, m.groups())
    return type(name, (StretchedLookup,), {"k": k, "after": after, "ngram_min": lo, "ngram_max": hi})


class StretchedLookup:
    k, after, ngram_min, ngram_max = 4, 2, 2, 4  # the shape; class_name() names a class with another

    def __init__(self, vllm_config):
        import vllm

        from qconv_vllm import check_version

        check_version(vllm.__version__)
        check_targets()
        spec = vllm_config.speculative_config
        self.block = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        if not (1 <= self.k <= self.block and 1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(
                f"{type(self).__name__}: need 1 <= k <= num_speculative_tokens ({self.block}) and "
                "1 <= ngram_min <= ngram_max"
            )
        self.rows: dict[int, Row] = {}

    def _match(self, context, n: int):
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        return _find_longest_matched_ngram_and_propose_tokens(
            context, self.ngram_min, self.ngram_max, self.max_model_len, n
        )

    def _streak(self, i: int, sampled: int, tokens: int) -> int:
        row = self.rows.get(i)
        if row is None or row.proposed == 0 or row.tokens + sampled != tokens:
            return 0
        return row.streak + 1 if sampled - 1 >= min(row.proposed, self.k) else 0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        out: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                self.rows.pop(i, None)
                out.append([])
                continue
            streak = self._streak(i, len(sampled), n)
            want = self.block if streak >= self.after else self.k
            draft = self._match(token_ids_cpu[i, :n], want).tolist()
            self.rows[i] = Row(n, len(draft), streak)
            out.append(draft)
        return out

    def load_model(self, *args, **kwargs) -> None:
        pass
