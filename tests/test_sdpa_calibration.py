"""The calibration passes' attention through torch's SDPA (convert.oneshot_fixes.sdpa_calibration): llmcompressor's
calibration context asks for eager attention; under qconv's patch each family's attention layers take the fused
kernel with the same mask and give what eager gives."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import TINY_FAMILIES


def _hidden(model, ids, mask, fused: bool) -> tuple[torch.Tensor, int]:
    """The last hidden states under llmcompressor's calibration context, and how many times SDPA ran."""
    from llmcompressor.utils.helpers import calibration_forward_context

    from qconv.convert.oneshot_fixes import sdpa_calibration

    calls = 0
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return sdpa(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
        with sdpa_calibration() if fused else torch.no_grad(), calibration_forward_context(model):
            assert model.config._attn_implementation == ("qconv_calibration_sdpa" if fused else "eager")
            out = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return out, calls


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_calibration_attention_is_fused_and_equals_eager(family, tiny_models, one_thread):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models(family), dtype=torch.float32)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    attention = sum(1 for t in types if t != "linear_attention")  # Gated-DeltaNet layers have no softmax attention
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 40))  # longer than gemma3's sliding window of 16
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row: the padding mask must reach the fused kernel too
    eager, eager_calls = _hidden(model, ids, mask, fused=False)
    fused, fused_calls = _hidden(model, ids, mask, fused=True)
    assert eager_calls == 0 and fused_calls == attention, (eager_calls, fused_calls, attention)
    assert model.config._attn_implementation not in ("eager", "qconv_calibration_sdpa")  # restored on exit
    keep = mask.bool()
    assert torch.allclose(fused[keep], eager[keep], atol=1e-5, rtol=1e-4), (fused[keep] - eager[keep]).abs().max()


def test_soft_capped_attention_stays_eager(tiny_models):
    """Where eager does more than softmax(QK^T + mask)V (here: logit soft-capping), the model's own eager runs."""
    from transformers import AutoModelForCausalLM

    from qconv.convert.oneshot_fixes import _masked_sdpa

    model = AutoModelForCausalLM.from_pretrained(tiny_models("gemma3"), dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 5, 32), torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    plain, weights = _masked_sdpa(attn, q, k, v, None, scaling=0.1)
    assert weights is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn.config, "attn_logit_softcapping", 5.0)
        capped, weights = _masked_sdpa(attn, q, k, v, None, scaling=0.1, softcap=5.0)
    assert weights is not None and not torch.allclose(plain, capped)


def test_a_plain_causal_mask_takes_the_causal_kernel_with_the_same_bits(tiny_models):
    """Unpadded calibration rows carry exactly the causal mask: the fused kernel is asked for `is_causal` (it skips
    the blocks above the diagonal) and gives the bits the masked call gives; a padded row or a window keeps its mask."""
    from transformers import AutoModelForCausalLM

    from qconv.convert.oneshot_fixes import _masked_sdpa

    attn = AutoModelForCausalLM.from_pretrained(tiny_models("qwen3"), dtype=torch.float32).model.layers[0].self_attn
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 300, 32), torch.randn(2, 2, 300, 32), torch.randn(2, 2, 300, 32)
    low = torch.finfo(torch.float32).min
    causal = torch.full((300, 300), low).triu(1).expand(2, 1, 300, 300).contiguous()
    padded, window = causal.clone(), causal.clone()
    padded[1, :, :, :7] = low
    window[:, :, 200:, :50] = low
    seen = []

    def recording(*a, **kw):
        seen.append(kw)
        return sdpa(*a, **kw)

    for mask, fast in ((causal, True), (padded, False), (window, False)):
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
            out, _ = _masked_sdpa(attn, q, k, v, mask, scaling=0.2)
        assert [(kw["is_causal"], kw["attn_mask"] is None) for kw in seen] == [(fast, fast)]
        want = sdpa(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True).transpose(1, 2).contiguous()
        assert torch.equal(out, want)
