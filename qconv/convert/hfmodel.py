"""Loading a source model or an artifact into transformers, for the places that need transformers' own modules
(calibration, reference logits, comparisons)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from qconv.convert import patches
from qconv.modelfiles import read_model_config


@contextlib.contextmanager
def _compressed_embeddings_loadable():
    """transformers 5.17's `_init_weights` reads `nn.Embedding.weight` without the None guard it has for Linear
    layers; a pack-quantized embed_tokens has `weight_packed` / `weight_scale` instead, so loading fails with
    "'Embedding' object has no attribute 'weight'". Skip such modules while loading (they are filled from the
    checkpoint), and restore the method afterwards."""
    from torch import nn

    orig = patches.current("init_weights")

    def guarded(self, module):
        if isinstance(module, nn.Embedding) and getattr(module, "weight", None) is None:
            return None
        return orig(self, module)

    with patches.swap(init_weights=guarded):
        yield


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = "bfloat16",
    decompress: bool = True,
    config: dict | None = None,
    device: str | None = None,
    **kwargs,
):
    """The model class the config names (AutoModelForCausalLM when transformers lacks it), in eval mode,
    compressed-tensors artifacts decompressed once at load to dense weights unless `decompress=False` (not unpacked
    again on every forward). `config`: its config.json when the caller has read it already; `device`: where to load
    it ("auto": a CUDA GPU when there is one; None: transformers' default, the CPU)."""
    import torch
    import transformers

    if device is not None:
        kwargs.setdefault(
            "device_map", ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        )
    if config is None:
        config = read_model_config(path)
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls or transformers.AutoModelForCausalLM
    qcfg = config.get("quantization_config") or {}
    if decompress and qcfg.get("quant_method") == "compressed-tensors":
        from transformers.utils.quantization_config import CompressedTensorsConfig

        kwargs.setdefault("quantization_config", CompressedTensorsConfig(dequantize=True))
    tied_packed = decompress and _tied_to_packed_embedding(path, config)
    if tied_packed:
        # transformers ties lm_head to embed_tokens.weight before decompressing, when the packed table has none:
        # load untied, then share the dequantized table
        cfg = transformers.AutoConfig.from_pretrained(path)
        for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
            c.tie_word_embeddings = False
        kwargs.setdefault("config", cfg)
    with _compressed_embeddings_loadable():
        model = cls.from_pretrained(path, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, **kwargs)
    if decompress and qcfg.get("transform_config"):
        _fold_rotations(model, Path(path), qcfg)
    if tied_packed:
        from compressed_tensors.offload import remove_dispatch

        # decompression leaves compressed-tensors' offload caches on the modules, which hand out a fresh tensor on
        # each access, so an assigned weight would not be shared: take them off first (tensors on their devices)
        remove_dispatch(model, onload_tensors=True)
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        for c in {
            id(model.config): model.config,
            id(model.config.get_text_config()): model.config.get_text_config(),
        }.values():
            c.tie_word_embeddings = True
    return model.eval()


def _fold_rotations(model, path: Path, qcfg: dict) -> None:
    """transformers loads a rotated Linear's stored weight W·V but not the online turn of its input
    (qconv.convert.rotation): fold Vᵀ into the dense weight."""
    import torch
    from compressed_tensors.offload import remove_dispatch

    from qconv.convert.rotation import input_rotations, stored_rotations

    remove_dispatch(model, onload_tensors=True)  # else each weight access hands out a fresh copy (see below)
    linears = {n: m.in_features for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    stored = stored_rotations(sorted(Path(path).glob("*.safetensors")))
    with torch.no_grad():
        for name, rot in input_rotations(qcfg, linears, stored, where=str(path)).items():
            w = model.get_submodule(name).weight
            w.copy_(rot.fold(w.detach()))


def _tied_to_packed_embedding(path: Path, config: dict) -> bool:
    """A tied model whose embed_tokens is stored packed (recipe tied_embeddings: keep) and no lm_head of its own."""
    tc = config.get("text_config") or config
    if not tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        return False
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        names = set()
        for f in Path(path).glob("*.safetensors"):
            with safe_open(f, "pt") as sf:
                names |= set(sf.keys())
    return any(n.endswith("embed_tokens.weight_packed") for n in names) and "lm_head.weight" not in names
