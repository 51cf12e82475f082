"""Reference log-probs of the source model, computed once per (source, text, window, stride, storage) and cached.

Two storages, named in every report:
- full: every log-prob as fp16 (|error| <= |log p| * 2**-11, largest on tokens of negligible probability);
  for vocabularies up to FULL_VOCAB_MAX.
- top-k: the k largest log-probs (fp32) + their ids; the tail mass is 1 - sum(top-k). Each position also keeps
  its exact entropy and the exact log-prob of the next token, so PPL and top-1 stay exact and the KLD of the
  unseen tail is bracketed (see metrics.kld_topk).
Windows are computed one at a time and written one file each, so memory stays at one window of logits. Each
window file records the sha256 of the token ids it was computed on, so a cache folder alone (copied from whoever
has the full-precision model) can stand in for the model: open_cached checks it window by window.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qconv.compute import dtype_name
from qconv.errors import QconvError
from qconv.fsutil import sha256_json, write_json_atomic
from qconv.paths import qconv_home

log = logging.getLogger(__name__)

FULL_VOCAB_MAX = 65_536
DEFAULT_TOPK = 1024


@dataclass
class RefWindow:
    target_logp: torch.Tensor  # [n] exact log p(next token), fp32
    entropy: torch.Tensor  # [n] exact H(P), fp32
    logp: torch.Tensor | None = None  # [n, V] fp16 (full storage)
    topk_idx: torch.Tensor | None = None  # [n, k] int64, sorted by descending probability
    topk_logp: torch.Tensor | None = None  # [n, k] fp32

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in vars(self).items() if v is not None}

    def rows(self, a: int, b: int) -> RefWindow:
        return RefWindow(**{k: v[a:b] for k, v in vars(self).items() if v is not None})

    @staticmethod
    def cat(parts: list[RefWindow]) -> RefWindow:
        return RefWindow(
            **{k: torch.cat([vars(p)[k] for p in parts]) for k, v in vars(parts[0]).items() if v is not None}
        )

    def top1(self) -> torch.Tensor:
        return self.topk_idx[:, 0] if self.logp is None else self.logp.argmax(-1)


def ref_window_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, topk: int | None, chunk: int = 256
) -> RefWindow:
    """logits [n, V] of the positions scored, targets [n] the tokens that follow them; `chunk` rows at a time, so
    that a large vocabulary's float32 temporaries stay a block's (248,320 x 2,048 is 2 GB each)."""
    parts = []
    for a in range(0, len(targets), chunk):
        logp = torch.log_softmax(logits[a : a + chunk].float(), dim=-1)
        part = {
            "entropy": -(logp.exp() * logp).sum(-1),
            "target_logp": logp.gather(-1, targets[a : a + chunk, None])[:, 0],
        }
        if topk:
            part["topk_logp"], part["topk_idx"] = logp.topk(topk, dim=-1, sorted=True)
        else:
            part["logp"] = logp.to(torch.float16)
        parts.append(part)
    return RefWindow(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]})


@dataclass
class Reference:
    """A cache folder of reference windows; `window(i)` loads one from disk."""

    folder: Path
    storage: str  # "full" | "topk"
    topk: int | None
    vocab_size: int

    def window(self, i: int) -> RefWindow:
        from safetensors.torch import load_file

        return RefWindow(**load_file(self.folder / f"window_{i:05d}.safetensors"))

    def describe(self) -> str:
        if self.storage == "full":
            return f"full log-probs of all {self.vocab_size} tokens, stored fp16"
        return (
            f"top-{self.topk} log-probs (fp32) + tail mass of {self.vocab_size} tokens, with exact entropy and "
            "next-token log-prob; KLD is bracketed per token (stated as kld_bound)"
        )


def choose_storage(vocab_size: int, topk: int | None) -> tuple[str, int | None]:
    """topk None: auto (full up to FULL_VOCAB_MAX, else DEFAULT_TOPK); 0: full; k: top-k."""
    if topk is None:
        topk = 0 if vocab_size <= FULL_VOCAB_MAX else DEFAULT_TOPK
    if topk < 0 or topk >= vocab_size:
        raise QconvError(
            f"--ref-topk {topk} is outside 0..{vocab_size - 1}",
            where="--ref-topk",
            fix="use 0 for full log-probs or a k smaller than the vocabulary",
        )
    return ("topk", topk) if topk else ("full", None)


@torch.inference_mode()
def window_logits(model, ids: list[int], first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of positions first..len-2 and the tokens they predict, for one window."""
    x = torch.tensor([ids], device=model.device)
    logits = model(input_ids=x, use_cache=False, logits_to_keep=0).logits[0, first:-1].float().cpu()
    return logits, x[0, first + 1 :].cpu()


def ids_sha256(ids: list[int]) -> str:
    """The token ids a reference window was computed on (tokenizer, text, window and stride in one hash)."""
    import numpy as np

    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def reference_key(
    source_sha256: str,
    text_sha256: str,
    window: int,
    stride: int,
    storage: str,
    topk: int | None,
    compute_dtype: str = "bfloat16",
) -> str:
    """The cache folder's name: every input of the reference logits, the dtype they were computed in included."""
    return sha256_json(
        {
            **({"compute": compute_dtype} if compute_dtype != "bfloat16" else {}),  # bf16 keeps its older keys
            "source": source_sha256,
            "text": text_sha256,
            "window": window,
            "stride": stride,
            "storage": storage,
            "topk": topk,
            "v": 1,
        }
    )[:32]


def build_reference(
    source_dir: str | Path,
    windows,
    *,
    source_sha256: str,
    text_sha256: str,
    logit_source,
    topk: int | None = None,
    num_parameters: int | None = None,
) -> Reference:
    """Reference for `windows` (text.Windows), computing only the windows not cached yet, from `logit_source`
    (forward.LogitSource over the source model)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(source_dir)
    vocab = cfg.get_text_config().vocab_size
    storage, k = choose_storage(vocab, topk)
    compute = dtype_name(logit_source.dtype)
    key = reference_key(source_sha256, text_sha256, windows.window, windows.stride, storage, k, compute)
    folder = qconv_home() / "reference" / key
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        folder / "meta.json",
        {
            "source_sha256": source_sha256,
            "text_sha256": text_sha256,
            "window": windows.window,
            "stride": windows.stride,
            "storage": storage,
            "topk": k,
            "vocab_size": vocab,
            "num_parameters": num_parameters,
            "compute_dtype": compute,
        },
    )
    missing = [i for i, ids in enumerate(windows.ids) if _recorded_ids(folder, i) != ids_sha256(ids)]
    if missing:
        log.info(
            "reference logits: computing %d of %d windows (%s) into %s",
            len(missing),
            len(windows.ids),
            storage if not k else f"top-{k}",
            folder,
        )
        for i, blocks in _progress(logit_source.logits(windows, missing), "reference", len(missing)):
            rw = RefWindow.cat([ref_window_from_logits(logits, targets, k) for logits, targets in blocks])
            tmp = folder / f".window_{i:05d}.{os.getpid()}.tmp"
            save_file(rw.to_tensors(), str(tmp), metadata={"ids_sha256": ids_sha256(windows.ids[i])})
            os.replace(tmp, folder / f"window_{i:05d}.safetensors")
    return Reference(folder=folder, storage=storage, topk=k, vocab_size=vocab)


def is_cache(path: str | Path) -> bool:
    """A reference cache folder (or its meta.json) rather than a model."""
    p = Path(path)
    p = p.parent if p.name == "meta.json" else p
    return (p / "meta.json").is_file() and not (p / "config.json").exists() and any(p.glob("window_*.safetensors"))


def cache_meta(path: str | Path) -> tuple[Path, dict]:
    p = Path(path)
    p = p.parent if p.name == "meta.json" else p
    try:
        return p, json.loads((p / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QconvError(
            f"cannot read the reference cache's meta.json: {e}",
            where=str(p),
            fix="pass a reference cache folder as qconv wrote it (QCONV_HOME/reference/<key>)",
        ) from e


def _recorded_ids(folder: Path, i: int) -> str | None:
    """The token-id hash window i's file records; None when the file is missing or records none."""
    from safetensors import safe_open

    f = folder / f"window_{i:05d}.safetensors"
    if not f.is_file():
        return None
    with safe_open(f, "pt") as st:
        return (st.metadata() or {}).get("ids_sha256")


def open_cached(path: str | Path, windows, *, text_sha256: str, vocab_size: int, topk: int | None) -> Reference:
    """A reference cache used without its model: it must have been computed on this text, with these windows and
    this tokenizer (every window's token-id hash), for this vocabulary, in the storage asked for."""
    folder, meta = cache_meta(path)
    fix = (
        "compute the reference on the same text/--window/--max-tokens with the full-precision model "
        "(`qconv eval ARTIFACT --reference MODEL`), or pass the settings the cache was made with"
    )
    for key, want in (
        ("text_sha256", text_sha256),
        ("window", windows.window),
        ("stride", windows.stride),
        ("vocab_size", vocab_size),
    ):
        if meta.get(key) != want:
            raise QconvError(
                f"reference cache {key} is {meta.get(key)!r}, this evaluation needs {want!r}",
                where=str(folder),
                fix=fix,
            )
    if topk is not None and (topk or None) != meta.get("topk"):
        raise QconvError(
            f"reference cache stores {meta.get('storage')} (topk {meta.get('topk')}), --ref-topk asked for {topk}",
            where=str(folder),
            fix="drop --ref-topk to use the cache as stored",
        )
    for i, ids in enumerate(windows.ids):
        recorded = _recorded_ids(folder, i)
        if recorded is None and not (folder / f"window_{i:05d}.safetensors").is_file():
            raise QconvError(
                f"reference cache has no window {i} (this text needs {len(windows.ids)} windows)",
                where=str(folder),
                fix=fix,
            )
        if recorded != ids_sha256(ids):
            raise QconvError(
                f"reference cache window {i} was computed on other tokens than this text gives with the artifact's "
                "tokenizer" + ("" if recorded else " (it records none: made by an older qconv)"),
                where=str(folder / f"window_{i:05d}.safetensors"),
                fix=fix,
            )
    return Reference(folder=folder, storage=meta["storage"], topk=meta.get("topk"), vocab_size=vocab_size)


def _progress(items, desc: str, total: int | None = None):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="window", leave=False, total=total)
