"""ModelSpec: what qconv knows about a model folder or artifact, made once from its config.json (read through
`qconv.modelfiles.read_model_config`, so a damaged file is one clear error). Commands take a ModelSpec instead of
a (path, config dict) pair and re-reading the file; its `family` says what the architecture is."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from qconv.modelfiles import read_model_config
from qconv.models.family import Family, LinearState, family_for

# where the decoder's weights live, per multimodal wrapper: its text weights sit under the language model
TEXT_PREFIX = {"Qwen3_5ForConditionalGeneration": "model.language_model."}


@dataclass(frozen=True)
class ModelSpec:
    folder: Path
    config: dict = field(repr=False)  # config.json as read
    text: dict = field(repr=False)  # the language model's part: `text_config`, or the top level
    model_type: str
    architectures: tuple[str, ...]
    family: Family
    weight_prefix: str
    layer_types: tuple[str, ...]
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int
    mtp_layers: int
    tie_embeddings: bool
    quantization_config: dict = field(repr=False)
    transform_config: dict = field(repr=False)
    sliding_window: int | None = None

    @classmethod
    def read(cls, folder: str | os.PathLike) -> ModelSpec:
        """The spec of a model folder or artifact: config.json read once, here."""
        return cls.from_config(folder, read_model_config(folder))

    @classmethod
    def from_config(cls, folder: str | os.PathLike, config: dict) -> ModelSpec:
        """The spec of an already-read config.json (of `folder`)."""
        folder = Path(folder)
        sub = config.get("text_config")
        text = sub if isinstance(sub, dict) else config
        model_type = config.get("model_type", "")
        archs = tuple(config.get("architectures") or ())
        family = family_for(model_type, list(archs), where=str(folder / "config.json"))
        n = int(text.get("num_hidden_layers") or 0)
        heads = int(text.get("num_attention_heads") or 0)
        hidden = int(text.get("hidden_size") or 0)
        qcfg = config.get("quantization_config") or text.get("quantization_config") or {}
        arch = archs[0] if archs else ""
        return cls(
            folder=folder,
            config=config,
            text=text,
            model_type=model_type,
            architectures=archs,
            family=family,
            weight_prefix=TEXT_PREFIX.get(arch, "model."),
            layer_types=family.layer_types(text),
            layers=n,
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or (hidden // heads if heads else 0)),
            hidden=hidden,
            intermediate=int(text.get("intermediate_size") or 0),
            vocab=int(text.get("vocab_size") or config.get("vocab_size") or 0),
            max_positions=int(text.get("max_position_embeddings") or 0),
            mtp_layers=int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0),
            tie_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            quantization_config=qcfg,
            transform_config=qcfg.get("transform_config") or {},
            sliding_window=text.get("sliding_window"),
        )

    @property
    def full_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def sliding_layers(self) -> int:
        """Sliding-window attention layers: K/V of the last `sliding_window` tokens only."""
        return sum(t == "sliding_attention" for t in self.layer_types)

    @property
    def linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def linear_state(self) -> LinearState | None:
        """The state one linear-attention layer keeps per sequence (None: the model has no such layer)."""
        if not self.linear_layers or self.family.linear_state is None:
            return None
        return self.family.linear_state(self.text)

    @property
    def hybrid(self) -> bool:
        return self.family.hybrid

    @property
    def multimodal(self) -> bool:
        return bool(set(self.architectures) & set(self.family.multimodal_archs))
