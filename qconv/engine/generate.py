"""Single-request generation: batch.py's prefill and decode steps on one row (per step draft -> verify all k+1
positions in one forward -> roll the cache back to the accepted length); counts forwards and acceptance per draft
position, and turns tokens into text."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch

from qconv.engine.batch import Sequence, decode, prefill
from qconv.engine.detok import TextStream
from qconv.engine.sampling import SamplingParams
from qconv.engine.spec import SpecConfig, make_speculator
from qconv.errors import QconvError

MAX_POS = 16  # draft positions counted in the statistics (max_block <= 15)


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop: tuple[str, ...] = ()
    spec: SpecConfig = field(default_factory=lambda: SpecConfig("none"))


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    forwards: int = 0  # target forwards, prefill included (it yields the first token)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: list[int] = field(default_factory=lambda: [0] * MAX_POS)  # steps that verified draft position i
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_POS)

    def record_step(self, drafted: int, accepted: int) -> None:
        self.forwards += 1
        for i in range(drafted):
            self.drafted[i] += 1
            self.accepted[i] += int(i < accepted)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.forwards, 1)

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "forwards": self.forwards,
            "tokens_per_step": round(self.tokens_per_step, 4),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "acceptance_per_position": [round(a / d, 4) for a, d in zip(self.accepted, self.drafted) if d],
        }


def generate_tokens(
    model, prompt: list[int], cfg: GenerationConfig, stats: GenerationStats | None = None
) -> Generator[int]:
    """Yield the new token ids for one prompt (batch.py's loop, one row). Lossless: with temperature 0 the output
    equals plain greedy decoding token for token (fp32); with sampling it follows the target's processed
    distribution exactly."""
    if not prompt:
        raise QconvError("empty prompt", fix="pass at least one token")
    stats = stats if stats is not None else GenerationStats()
    limit = getattr(model.config, "max_position_embeddings", len(prompt) + cfg.max_tokens)
    if len(prompt) + cfg.max_tokens > limit:
        raise QconvError(
            f"prompt ({len(prompt)}) + max tokens ({cfg.max_tokens}) exceed the model's context ({limit})",
            fix="shorten the prompt or lower --max-tokens",
        )
    gen = torch.Generator().manual_seed(cfg.seed)
    seq = Sequence(list(prompt), cfg.max_tokens, cfg.sampling, gen, make_speculator(cfg.spec, model, cfg.sampling, gen))
    eos = set(model.config.eos_token_ids)
    max_len = len(prompt) + cfg.max_tokens + cfg.spec.max_block + 1  # a verify forward writes past the sequence
    cache = model.new_cache(1, max_len)
    stats.prompt_tokens += len(prompt)
    with torch.inference_mode():
        t0 = time.perf_counter()
        (new,) = prefill(model, cache, [seq])
        stats.record_step(0, 0)
        stats.prefill_s += time.perf_counter() - t0
        t_dec = time.perf_counter()
        try:
            while True:
                for t in new:
                    seq.out_ids.append(t)
                    stats.new_tokens += 1
                    yield t
                    if t in eos or len(seq.out_ids) >= cfg.max_tokens:
                        return
                (draft,), (new,) = decode(model, cache, [seq], max_len)
                stats.record_step(len(draft), len(new) - 1)
        finally:
            stats.decode_s += time.perf_counter() - t_dec


def stream_text(tokenizer, tokens: Generator[int], stop: tuple[str, ...] = ()) -> Iterator[str]:
    """Text as it becomes final (see detok.TextStream); at the first stop string the generator is closed, so its
    statistics are final, and neither the stop string nor anything after it is emitted."""
    ts = TextStream(tokenizer, stop)
    for t in tokens:
        if piece := ts.push([t]):
            yield piece
        if ts.stopped:
            tokens.close()
            return
    if piece := ts.finish():
        yield piece


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for a raw prompt, or for one user turn through the model's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise QconvError("this tokenizer has no chat template", fix="use --prompt instead of --chat")
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
