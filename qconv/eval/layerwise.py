"""Layer-streamed forward: the logits of every evaluation window without ever holding the whole model.

The model is built on the meta device from its config (transformers' own classes: llama, qwen3, the qwen3_5 hybrid
with its Gated-DeltaNet layers). Then, reading tensors from safetensors as they are needed (an artifact's
compressed-tensors weights dequantized model-free by qconv.convert.dequant):
1. the embedding turns every window into hidden states (kept on the CPU, bf16), then is dropped;
2. each decoder layer in turn is loaded onto the device, every window is pushed through it, and it is dropped;
3. the final norm and the lm_head score the windows, `row_block` positions at a time.
Peak memory: the larger of embedding and lm_head + one layer + the windows' hidden states + one block of logits.

The inputs every layer takes besides the hidden states (rotary cos/sin, the causal and recurrent masks) are
captured from the model's own forward, run once with the layers swapped for recorders: no family's mask or
position logic is rewritten here, so each window sees exactly what the whole-model path gives it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qconv.convert.dequant import dequantize_tensors
from qconv.errors import QconvError
from qconv.modelfiles import read_model_config

log = logging.getLogger(__name__)

# Checkpoint prefixes of the text model besides the model's own names: a Qwen3_5ForConditionalGeneration
# checkpoint keeps the language model under model.language_model.*, which Qwen3_5ForCausalLM calls model.*.
PREFIX_ALIASES = (("model.", "model.language_model."),)
ROW_BLOCK = 512


@dataclass
class Checkpoint:
    """A model folder read by tensor-name prefix; compressed-tensors weights come back dequantized (bf16)."""

    path: Path
    files: dict[str, Path]  # tensor name -> the shard that holds it
    quantization: dict | None = None  # config.json's quantization_config, when compressed-tensors
    _prefix_map: dict[str, str] = field(default_factory=dict)
    _rotations: dict[str, torch.Tensor] | None = None  # the input-rotation blocks, read on first need

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        from qconv.convert.stream import tensor_files

        path = Path(path)
        files = tensor_files(path)
        if not files:
            raise QconvError(
                f"no safetensors in {path}",
                where=str(path),
                fix="layer streaming reads safetensors shards; convert the checkpoint first",
            )
        qcfg = read_model_config(path).get("quantization_config") or {}
        return cls(path, files, qcfg if qcfg.get("quant_method") == "compressed-tensors" else None)

    def resolve(self, prefix: str) -> str | None:
        """The checkpoint's spelling of a module prefix ('model.layers.3.'), or None when nothing is stored there."""
        if prefix not in self._prefix_map:
            found = None
            for a, b in ((None, None),) + PREFIX_ALIASES:
                p = prefix if a is None else (b + prefix[len(a) :] if prefix.startswith(a) else None)
                if p and any(n.startswith(p) for n in self.files):
                    found = p
                    break
            self._prefix_map[prefix] = found
        return self._prefix_map[prefix]

    def read(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor under the module prefix, by local name (the prefix stripped), dequantized."""
        from safetensors import safe_open

        p = self.resolve(prefix)
        if p is None:
            raise QconvError(
                f"no tensors under {prefix} in {self.path}",
                where=str(self.path),
                fix="the checkpoint does not match its config.json; re-download or rebuild it",
            )
        names = [n for n in self.files if n.startswith(p)]
        out: dict[str, torch.Tensor] = {}
        for shard in sorted({self.files[n] for n in names}):
            with safe_open(str(shard), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in names if self.files[n] == shard})
        if self.quantization is not None:
            if self._rotations is None:
                from qconv.convert.rotation import stored_rotations

                self._rotations = stored_rotations(sorted(set(self.files.values())))
            out = dequantize_tensors(
                self.quantization, out, torch.bfloat16, where=str(self.path), rotations=self._rotations
            )
        return {n[len(p) :]: t for n, t in out.items()}


def layer_output(out) -> torch.Tensor:
    """A decoder layer's hidden states (some families return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer `i` in the model's forward: records what the layer is given, passes through."""

    def __init__(self, i: int, seen: dict):
        super().__init__()
        self.i, self.seen = i, seen

    def forward(self, hidden_states, *args, **kwargs):
        self.seen[self.i] = (args, kwargs)
        return hidden_states


def _load(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], device, where: str, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Materialize a meta module from a state dict (all of it, nothing else) on `device`: its floating tensors as
    the bf16 model holds them, computed in `dtype` (qconv.compute)."""
    want = set(module.state_dict())
    missing, extra = want - set(tensors), set(tensors) - want
    if missing:
        raise QconvError(
            f"{where}: tensors missing from the checkpoint: {sorted(missing)[:5]}",
            where=where,
            fix="the checkpoint does not match its config.json; re-download or rebuild it",
        )
    sd = {
        k: tensors[k].to(device=device, dtype=torch.bfloat16).to(dtype)
        if tensors[k].is_floating_point()
        else tensors[k].to(device)
        for k in want
    }
    if extra:
        log.debug("%s: ignoring %d stored tensors the module does not use: %s", where, len(extra), sorted(extra)[:5])
    module.load_state_dict(sd, strict=True, assign=True)


def _free(module: torch.nn.Module) -> None:
    module.to("meta")


@dataclass
class StreamedModel:
    """A causal LM on the meta device whose weights stay in `ckpt` until a stage needs them."""

    ckpt: Checkpoint
    model: torch.nn.Module  # the full model, meta device (rotary buffers real)
    device: torch.device
    dtype: torch.dtype = torch.bfloat16  # what the layers compute in (the weights are the bf16 model's either way)
    row_block: int = ROW_BLOCK

    @classmethod
    def open(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
    ) -> StreamedModel:
        import transformers

        from qconv.convert.stream import rebuild_meta_buffers
        from qconv.memory import pin_mmap_threshold
        from qconv.models.family import family_for

        pin_mmap_threshold()  # each layer's tensors are freed before the next: give them back (see qconv.memory)
        cfg = transformers.AutoConfig.from_pretrained(path)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # the weights come dequantized: build plain bf16 modules
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        rebuild_meta_buffers(model, family_for(cfg.model_type, where=str(Path(path) / "config.json")))
        model.eval()
        return cls(Checkpoint.open(path), model, torch.device(device), dtype)

    @property
    def config(self):
        return self.model.config

    @contextlib.contextmanager
    def loaded(self, module: torch.nn.Module, where: str):
        """`module` with its weights read from the checkpoint, for the block's duration (then meta again)."""
        _load(module, self.ckpt.read(self._prefix(module)), self.device, where, self.dtype)
        try:
            yield module
        finally:
            _free(module)

    def _names(self) -> dict[int, str]:
        return {id(m): n for n, m in self.model.named_modules()}

    def _prefix(self, module) -> str:
        return self._names()[id(module)] + "."

    @torch.inference_mode()
    def embed(self, windows: list[list[int]]) -> torch.Tensor:
        """[W, T, H] in the model's compute dtype, on the CPU."""
        with self.loaded(self.model.get_input_embeddings(), "embedding") as emb:
            return torch.stack([emb(torch.tensor(ids, device=self.device)).cpu() for ids in windows])

    @torch.inference_mode()
    def layer_inputs(self, seq_len: int) -> dict[int, tuple[tuple, dict]]:
        """What the model's own forward hands decoder layer i for one window of `seq_len` tokens."""
        dec = self.model.get_decoder()
        real, seen = dec.layers, {}
        dec.layers = torch.nn.ModuleList([_Recorder(i, seen) for i in range(len(real))])
        try:
            x = torch.zeros(1, seq_len, self.config.get_text_config().hidden_size, dtype=self.dtype, device=self.device)
            norm = dec.norm
            dec.norm = torch.nn.Identity()
            try:
                dec(inputs_embeds=x, use_cache=False)
            finally:
                dec.norm = norm
        finally:
            dec.layers = real
        return seen

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every window through layer 0, then every window through layer 1, ... (in place on `hidden`)."""
        from tqdm.auto import tqdm

        inputs = self.layer_inputs(hidden.shape[1])
        layers = self.model.get_decoder().layers
        for i, layer in enumerate(tqdm(layers, desc="layers (streamed)", unit="layer", leave=False)):
            args, kwargs = inputs[i]
            with self.loaded(layer, f"decoder layer {i}"):
                for w in range(hidden.shape[0]):
                    out = layer_output(layer(hidden[w : w + 1].to(self.device), *args, **kwargs))
                    hidden[w] = out[0].to(hidden.device)
        return hidden

    @contextlib.contextmanager
    def head(self) -> Iterator[tuple[torch.nn.Module, torch.nn.Module]]:
        """The final norm and the lm_head (the embedding's table when they are tied), loaded for the block."""
        dec, head = self.model.get_decoder(), self.model.get_output_embeddings()
        prefix = self._prefix(head)
        if self.ckpt.resolve(prefix) is None:  # tied: the lm_head is the embedding
            prefix = self._prefix(self.model.get_input_embeddings())
        _load(dec.norm, self.ckpt.read(self._prefix(dec.norm)), self.device, "final norm", self.dtype)
        try:
            _load(head, self.ckpt.read(prefix), self.device, "lm_head", self.dtype)
            yield dec.norm, head
        finally:
            _free(dec.norm)
            _free(head)

    def window_logits(
        self, hidden: torch.Tensor, windows: list[list[int]], firsts: list[int]
    ) -> Iterator[tuple[int, Iterator[tuple[torch.Tensor, torch.Tensor]]]]:
        """(window index, its blocks), a block being the float32 logits of `row_block` of the positions first..T-2
        and the tokens they predict: a large vocabulary's logits are never held for a whole window."""
        with self.head() as (norm, head):
            for w, (ids, first) in enumerate(zip(windows, firsts)):
                yield w, self._blocks(norm, head, hidden[w, first:-1], torch.tensor(ids[first + 1 :]))

    @torch.inference_mode()
    def _blocks(self, norm, head, h: torch.Tensor, targets: torch.Tensor):
        for a in range(0, len(h), self.row_block):
            yield head(norm(h[a : a + self.row_block].to(self.device))).float().cpu(), targets[a : a + self.row_block]


def streamed_logits(
    path: str | Path,
    windows: list[list[int]],
    firsts: list[int],
    *,
    device: str = "cpu",
    kv_scheme=None,
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[int, Iterator[tuple[torch.Tensor, torch.Tensor]]]]:
    """The layer-streamed equivalent of running `reference.window_logits` on each window of a loaded model."""
    from qconv.eval.kvsim import kv_simulation

    if len({len(w) for w in windows}) > 1:
        raise QconvError(
            "streamed evaluation needs windows of one length",
            where="--window",
            fix="this is a bug: text.make_windows makes equal windows",
        )
    sm = StreamedModel.open(path, device, dtype=dtype)
    with kv_simulation(sm.model, kv_scheme):
        hidden = sm.run_layers(sm.embed(windows))
        yield from sm.window_logits(hidden, windows, firsts)
