"""KVarN inside attention on a real model (SmolLM2-135M, head_dim 64): k4v4 must beat int4 per token (q4_0-like) at
no more bytes -- at head_dim 64 that takes the 256-token tile (g128: 73 B/token/head vs 72, g256: 71.5)."""

import pytest
import torch


@pytest.mark.slow
def test_kvarn_k4v4_beats_int4_per_token_on_smollm2(smollm2, shared_data, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qconv.eval.kvsim import get_scheme, kv_simulation
    from qconv.kv import get_kv_scheme

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    text = (shared_data / "wikitext-2-raw-test.txt").read_text()[200_000:260_000]
    x = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:768]])
    first = 384  # g128: sink + 5 quantized tiles, g256: sink + 2; the second half is scored

    @torch.inference_mode()
    def logp():
        logits = model(input_ids=x, use_cache=False, logits_to_keep=x.shape[1] - first + 1).logits
        return torch.log_softmax(logits[0, :-1], -1)

    ref = logp()
    kld = {}
    for name in ("int4_g32", "kvarn_k4v4_g128", "kvarn_k4v4_g256"):
        with kv_simulation(model, get_scheme(name)):
            kld[name] = float((ref.exp() * (ref - logp())).sum(-1).mean())
    assert 0 < kld["kvarn_k4v4_g128"] < 0.5 * kld["int4_g32"], kld
    assert 0 < kld["kvarn_k4v4_g256"] < 0.5 * kld["int4_g32"], kld
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert get_kv_scheme("kvarn_k4v4_g256").bytes_per_token_per_head(head_dim) <= get_kv_scheme(
        "int4_g32"
    ).bytes_per_token_per_head(head_dim)
