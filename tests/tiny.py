"""Tiny seeded random models of each family we support, saved like real checkpoints (bf16 safetensors +
tokenizer with a chat template). qwen3_5 also gets random `mtp.*` weights, as the real checkpoint has them."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tiny model needs a tiny tokenizer to be useful in tests. "
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n 0123456789 + - * / = ( ) [ ] { } "
) * 4

VOCAB = 512
STD = 0.02
# One tiny fixture per model family (tiny_config's name for it): the tests parametrized over families run each.
# A new family adds its entry here and its config in tiny_config.
TINY_FAMILIES = ("llama", "qwen3", "qwen3_5", "gemma3")


def make_tokenizer(vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    return fast


def tiny_config(family: str, vocab: int):
    """The tiny transformers config of one family: every family shares the widths, the layer count and the ids."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config

    common = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True, **common)
    if family == "llama_tp":  # twice as wide: split over 2 tensor-parallel ranks, rows keep whole groups of 128
        return LlamaConfig(
            num_hidden_layers=2, tie_word_embeddings=True, **{**common, "hidden_size": 256, "intermediate_size": 512}
        )
    if family == "qwen2":  # q/k/v biases
        return Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **common)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False, **common)
    if family == "gemma3":  # a sliding-window layer (window 16: the tests' prompts outgrow it) and a global one,
        # each with its own rope theta; query_pre_attn_scalar != head_dim so the attention scale is exercised
        return Gemma3TextConfig(
            num_hidden_layers=2,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=16,
            query_pre_attn_scalar=48,
            tie_word_embeddings=True,
            **common,
        )
    if family == "qwen3_5":
        return Qwen3_5TextConfig(
            num_hidden_layers=4,
            head_dim=64,
            full_attention_interval=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
            mtp_num_hidden_layers=1,
            **common,
        )
    if family in ("qwen3_5_wide", "qwen3_5_wide_tied", "qwen3_5_tp"):  # Gated-DeltaNet heads of the real width
        # (128): vLLM's CPU GDN kernel needs them; `_tied` as the small Qwen3.5 models are; `_tp` with twice the heads,
        # so 2 tensor-parallel ranks each hold one key head
        return Qwen3_5TextConfig(
            num_hidden_layers=4,
            head_dim=64,
            full_attention_interval=2,
            linear_num_key_heads=2 if family.endswith("_tp") else 1,
            linear_num_value_heads=4 if family.endswith("_tp") else 2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=family.endswith("_tied"),
            mtp_num_hidden_layers=1,
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}")


def mtp_weights(model, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random weights for the real checkpoint's MTP head, with the names and shapes the planner sizes it by
    (`qconv.convert.layout.mtp_shapes`): matrices ~N(0, 0.02), norms ones."""
    from qconv.convert.layout import mtp_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in mtp_shapes(model.config.to_dict()).items():
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(*shape, generator=g) * 0.02
        out[name] = t.to(torch.bfloat16)
    return out


def make_tiny_model(family: str, out: Path, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tok)))
    with torch.no_grad():  # seeded, explicit init so every family's weights have the same spread
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, STD)
            elif family == "gemma3":  # (1 + w) norms start at w = 0: spread them so each norm's weight matters
                p.normal_(0, 0.1)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if family.startswith("qwen3_5"):
        shard = out / "model.safetensors"
        tensors = load_file(shard)
        tensors.update(mtp_weights(model))
        save_file(tensors, shard, metadata={"format": "pt"})
    return out


# Every width of the 27B shrunk; field names, layer pattern (3 Gated-DeltaNet : 1 full attention), MTP depth and
# the vision tower's structure kept. head_dim 64 with partial_rotary_factor 0.25 leaves 8 rotary pairs: the mrope
# sections are rescaled to sum to 8.
REAL_LAYOUT_TEXT = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=4096,
)
REAL_LAYOUT_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, num_position_embeddings=64)
REAL_LAYOUT_SHARD = "600KB"


def fit_mrope(tc: dict) -> dict:
    """Rescale a qwen3_5 text config's mrope sections (in place) to its rotary pairs after head_dim shrank."""
    rope = tc["rope_parameters"]
    pairs = int(tc["head_dim"] * rope["partial_rotary_factor"]) // 2
    sec = [s * pairs // sum(rope["mrope_section"]) for s in rope["mrope_section"]]
    sec[0] += pairs - sum(sec)
    rope["mrope_section"] = sec
    return tc


def real_layout_config(config_27b: Path, vocab: int) -> dict:
    """The 27B's config.json with every width shrunk (same keys, same layer pattern)."""
    import json

    cfg = json.loads((Path(config_27b) / "config.json").read_text())
    tc, vc = cfg["text_config"], cfg["vision_config"]
    tc.update(REAL_LAYOUT_TEXT, vocab_size=vocab)
    tc["layer_types"] = tc["layer_types"][: tc["num_hidden_layers"]]
    fit_mrope(tc)
    vc.update(REAL_LAYOUT_VISION, out_hidden_size=tc["hidden_size"])
    for i, key in enumerate(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")):
        cfg[key] = vocab - 4 + i  # inside the tiny vocabulary
    tc.update(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    return cfg


def make_real_layout_model(config_27b: Path, out: Path, seed: int = 0) -> Path:
    """A seeded Qwen3_5ForConditionalGeneration saved like the published checkpoint: text weights under
    model.language_model.*, a tiny vision tower under model.visual.*, mtp.* tensors transformers does not load in
    their own shard, several safetensors shards and an index."""
    import json

    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = make_tokenizer()
    cfg = real_layout_config(config_27b, len(tok))
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, STD)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=REAL_LAYOUT_SHARD)
    tok.save_pretrained(out)
    mtp = {}
    g = torch.Generator().manual_seed(seed + 1)
    from qconv.convert.layout import mtp_shapes

    for name, shape in mtp_shapes(cfg["text_config"]).items():
        mtp[name] = (torch.ones(shape) if len(shape) == 1 else torch.randn(*shape, generator=g) * STD).to(
            torch.bfloat16
        )
    shard = "model-mtp-00001.safetensors"
    save_file(mtp, out / shard, metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: shard for k in mtp})
    index_path.write_text(json.dumps(index, indent=2))
    return out


def hf_model(path):
    """transformers' float32 model of `path` (the parity reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_tokens(vocab: int, n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g)


def parity(path, prompt_len: int = 40, steps: int = 32, device: str = "cpu") -> tuple[float, float]:
    """Max |Δlogit| vs transformers on a prefill and on `steps` greedy decode steps (reference picks the tokens).
    `device`: both models run there (bench/gpu_day.py uses cuda). Here, free of pytest, for that script."""
    from qconv.engine import load_model

    ref, ours = hf_model(path).to(device), load_model(path).to(device)
    toks = random_tokens(ours.config.vocab_size, prompt_len).to(device)
    cache = ours.new_cache(1, prompt_len + steps + 1)
    with torch.no_grad():
        out = ref(toks, use_cache=True)
        pre = (out.logits - ours(toks, cache)).abs().max().item()
        dec, pkv = 0.0, out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = ref(nxt, past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            dec = max(dec, (out.logits - ours(nxt, cache)).abs().max().item())
            nxt = out.logits[:, -1:].argmax(-1)
    return pre, dec
