"""Our runtime model code against transformers (logit parity), and the cache contract: rollback, batched slots."""

from __future__ import annotations

import pytest
import torch

from qconv.engine import load_model
from tests.tiny import TINY_FAMILIES, parity
from tests.tiny import hf_model as _hf
from tests.tiny import random_tokens as _tokens

TOL = 1e-3  # max |logit difference| in fp32


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls on a shared 2-core box: one thread avoids OpenMP oversubscription stalls (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """qwen2 (q/k/v biases) is not among the shared fixtures; a seeded random one, saved the same way, with every
    parameter drawn (make_tiny_model leaves the biases at zero, which would hide a bias bug)."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import make_tokenizer, tiny_config

    tok, out = make_tokenizer(), tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", len(tok)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logit_parity_tiny(tiny_models, family):
    pre, dec = parity(tiny_models(family), prompt_len=90)  # 90 > one 64-token GDN chunk, > gemma3's 16-token window
    assert pre <= TOL and dec <= TOL, (pre, dec)


def test_logit_parity_qwen2_biases(tiny_qwen2):
    assert load_model(tiny_qwen2).config.attention_bias
    pre, dec = parity(tiny_qwen2, prompt_len=20, steps=8)
    assert pre <= TOL and dec <= TOL, (pre, dec)


def test_config_of_real_27b(config_27b):
    """The flagship's multimodal config: text weights under model.language_model., 16 full + 48 GDN layers."""
    from qconv.engine.config import load_config

    c = load_config(config_27b)
    assert (c.family, c.weight_prefix, c.rotary_dim) == ("qwen3_5", "model.language_model.", c.head_dim // 4)
    assert len(c.full_layers) * 4 == c.num_layers and c.layer_types[3] == "full_attention"
    assert c.norm_offset == 1.0 and c.attn_output_gate and c.qk_norm


@pytest.mark.slow
def test_logit_parity_smollm2(smollm2):
    pre, dec = parity(smollm2, prompt_len=48)
    assert pre <= TOL and dec <= TOL, (pre, dec)


def test_qwen35_decode_matches_chunked_prefill(tiny_qwen3_5):
    m = load_model(tiny_qwen3_5)
    toks = _tokens(m.config.vocab_size, 80)
    whole = m(toks, m.new_cache(1, 96))
    cache = m.new_cache(1, 96)
    steps = torch.cat([m(toks[:, i : i + 1], cache) for i in range(80)], dim=1)
    assert (whole - steps).abs().max().item() <= TOL


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rollback_equals_never_seen(tiny_models, family):
    m = load_model(tiny_models(family))
    V = m.config.vocab_size
    prefix, block, tail = _tokens(V, 70, 1), _tokens(V, 9, 2), _tokens(V, 3, 3)
    ref_cache = m.new_cache(1, 128)
    m(prefix, ref_cache)
    for n_keep in range(0, block.shape[1] + 1):
        cache = m.new_cache(1, 128)
        m(prefix, cache)
        m(block, cache)
        cache.rollback([0], [70 + n_keep])
        got = m(tail, cache)
        fresh = m.new_cache(1, 128)
        want = m(torch.cat([prefix, block[:, :n_keep], tail], dim=1), fresh)[:, -3:]
        assert (got - want).abs().max().item() <= TOL, n_keep
        assert int(cache.lengths[0]) == 73 + n_keep


def test_rollback_into_long_forward_window(tiny_qwen3_5):
    """A forward longer than max_rollback keeps only its last tokens reachable; going further back is an error."""
    from qconv.errors import QconvError

    m = load_model(tiny_qwen3_5)
    toks, tail = _tokens(m.config.vocab_size, 100, 4), _tokens(m.config.vocab_size, 2, 5)
    cache = m.new_cache(1, 128)
    cache.max_rollback = 16
    m(toks, cache)
    cache.rollback([0], [90])
    want = m(torch.cat([toks[:, :90], tail], dim=1), m.new_cache(1, 128))[:, -2:]
    assert (m(tail, cache) - want).abs().max().item() <= TOL
    with pytest.raises(QconvError):
        cache.rollback([0], [50])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_batched_slots_match_single(tiny_models, family):
    m = load_model(tiny_models(family))
    V = m.config.vocab_size
    prompts = [_tokens(V, n, 10 + n) for n in (5, 23, 12)]
    slots = [2, 0, 3]  # non-contiguous, out of order
    cache = m.new_cache(4, 64)
    for p, s in zip(prompts, slots):
        m(p, cache, slots=[s])
    steps = _tokens(V, 6, 7, batch=3)
    batched = torch.cat([m(steps[:, i : i + 2], cache, slots=torch.tensor(slots)) for i in range(0, 6, 2)], dim=1)
    for b, p in enumerate(prompts):
        alone = m(torch.cat([p, steps[b : b + 1]], dim=1), m.new_cache(1, 64))[:, -6:]
        assert (batched[b : b + 1] - alone).abs().max().item() <= TOL, b
    cache.reset([0])
    assert int(cache.lengths[0]) == 0 and int(cache.lengths[2]) == 11


def test_runtime_kv_store_is_the_eval_codec():
    """fp8_e4m3 (and every other scheme) in the runtime cache is qconv.kv's codec: a prompt written to the runtime's
    store reads back exactly as `qconv eval --kv` simulates it (amax-scaled fp8, calibrated on that prompt)."""
    from qconv.engine.cache import make_kv_store
    from qconv.kv import get_kv_scheme

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 70, 4, 32, generator=g) * 3  # [B, T, H, D]
    for name in ("fp8_e4m3", "kvarn_k4v2_g64"):
        store = make_kv_store(name, 1, 1, 80, 4, 32, torch.float32)
        store.write(0, [0], [0], k, v)
        got_k, got_v = store.read(0, [0], 70)
        want_k, want_v = get_kv_scheme(name).fake_quant(k.transpose(1, 2), v.transpose(1, 2))
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), name
    assert (got_k - k.transpose(1, 2)).abs().max() > 0  # it did quantize


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "kvarn_k4v4_g64"])
def test_eval_kv_simulation_matches_runtime_decode(tiny_qwen3, scheme):
    """transformers with `qconv eval`'s KV simulation vs our runtime on the same tokens, fp32: the prompt prefilled
    in one forward is the prefill form; the decode-time form is what one-token decode steps read (a token
    quantized once its tile has closed; the sink and the tile being filled exact)."""
    from qconv.eval.kvsim import get_scheme, kv_simulation

    ref, ours = _hf(tiny_qwen3), load_model(tiny_qwen3)
    n_prompt, n = 8, 140
    toks = _tokens(ours.config.vocab_size, n)
    with torch.no_grad(), kv_simulation(ref, get_scheme(scheme, "prefill")):
        ref_prefill = ref(toks[:, :n_prompt]).logits
    cache = ours.new_cache(1, n, kv_scheme=scheme)
    assert (ours(toks[:, :n_prompt], cache) - ref_prefill).abs().max().item() < 1e-2
    steps = torch.cat([ours(toks[:, i : i + 1], cache) for i in range(n_prompt, n)], 1)
    with torch.no_grad(), kv_simulation(ref, get_scheme(scheme, "decode")):
        decode_form = ref(toks).logits[:, n_prompt:]
    with torch.no_grad(), kv_simulation(ref, get_scheme(scheme, "prefill")):
        prefill_form = ref(toks).logits[:, n_prompt:]
    if scheme == "fp8_e4m3":  # fp8's scales come from the prompt in the runtime, from the whole text in eval
        assert (steps - decode_form).abs().max().item() < 0.1 * steps.abs().max().item()
        return
    near, far = (steps - decode_form).abs().max().item(), (steps - prefill_form).abs().max().item()
    assert near < 1e-2 < far, (near, far)


def _mtp_reference(path, hidden, next_tokens):
    """The MTP math (vLLM qwen3_next_mtp) assembled from transformers' own qwen3_5 modules and the mtp.* weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
    )

    cfg = AutoConfig.from_pretrained(path)
    w = {k[4:]: v.float() for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.")}
    emb = load_file(path / "model.safetensors")["model.embed_tokens.weight"].float()
    layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention")).float().eval()
    layer.load_state_dict({k[len("layers.0.") :]: v for k, v in w.items() if k.startswith("layers.0.")})
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[n].load_state_dict({"weight": w[f"{n}.weight"]})
    T = next_tokens.shape[1]
    x = torch.cat([norms["pre_fc_norm_embedding"](emb[next_tokens]), norms["pre_fc_norm_hidden"](hidden)], -1)
    x = x @ w["fc.weight"].T
    pos = torch.arange(T)[None]
    rope = Qwen3_5TextRotaryEmbedding(cfg)(x, pos[None].expand(3, 1, T))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return norms["norm"](layer(x, position_embeddings=rope, attention_mask=mask, position_ids=pos))


def test_mtp_matches_reference_and_chains(tiny_qwen3_5):
    m = load_model(tiny_qwen3_5)
    assert m.config.has_mtp and m.mtp is not None
    toks = _tokens(m.config.vocab_size, 12)
    cache = m.new_cache(1, 32)
    _, hidden = m(toks[:, :11], cache, return_hidden=True)
    logits, h = m.mtp(hidden, toks[:, 1:12], cache)
    ref_h = _mtp_reference(tiny_qwen3_5, hidden.float(), toks[:, 1:12])
    assert (h - ref_h).abs().max().item() <= TOL
    assert (logits - m.logits(ref_h)).abs().max().item() <= TOL
    # one pair at a time through the MTP cache gives the same as all at once
    c2 = m.new_cache(1, 32)
    m(toks[:, :11], c2)
    step = torch.cat([m.mtp(hidden[:, i : i + 1], toks[:, i + 1 : i + 2], c2)[0] for i in range(11)], dim=1)
    assert (step - logits).abs().max().item() <= TOL
    assert int(c2.mtp.lengths[0]) == 11


def _int_group(bits: int, group: int, symmetric: bool = True):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group)


def _quantize(src, out, groups: dict[str, tuple[list[str], int, int]], ignore=(), asymmetric=()):
    """A compressed-tensors artifact made by llmcompressor itself (RTN weight-only, no calibration data); the
    groups named in `asymmetric` get zero points."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    schemes = {
        k: QuantizationScheme(targets=t, weights=_int_group(b, g, k not in asymmetric))
        for k, (t, b, g) in groups.items()
    }
    oneshot(model=model, recipe=QuantizationModifier(config_groups=schemes, ignore=list(ignore)))
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _dense_embedding_copy(art, out):
    """transformers cannot load a compressed embed_tokens; give it the same int8 embedding, dequantized by hand."""
    import json
    import shutil

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    shutil.copytree(art, out)
    t = load_file(art / "model.safetensors")
    name = "model.embed_tokens."
    shape = t.pop(name + "weight_shape")
    q = unpack_from_int32(t.pop(name + "weight_packed"), 8, shape).float()
    scale = t.pop(name + "weight_scale").float()
    t[name + "weight"] = (q.view(shape[0], scale.shape[1], -1) * scale[..., None]).reshape(q.shape)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((art / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["targets"] = [x for x in g["targets"] if "embed_tokens" not in x]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _max_diff_vs_transformers(ours_path, ref_path, n: int = 24) -> float:
    ref, ours = _hf(ref_path), load_model(ours_path)
    toks = _tokens(ours.config.vocab_size, n)
    with torch.no_grad():
        return (ref(toks).logits - ours(toks, ours.new_cache(1, n))).abs().max().item()


@pytest.mark.slow
def test_quantized_artifacts_match_transformers(tiny_qwen3, tiny_qwen3_5, tmp_path):
    """int4 g64 + g128 packed, int8 lm_head + embed_tokens (qwen3); int4 GDN/attention/MLP, int8 lm_head (qwen3_5)."""
    art = _quantize(
        tiny_qwen3,
        tmp_path / "q3",
        {
            "mlp": (["re:.*mlp.*"], 4, 64),
            "attn": (["re:.*self_attn.*"], 4, 128),
            "int8": (["re:.*lm_head$", "re:.*embed_tokens$"], 8, 128),
        },
    )
    from safetensors import safe_open

    with safe_open(art / "model.safetensors", "pt") as f:
        assert {"model.embed_tokens.weight_packed", "lm_head.weight_packed"} <= set(f.keys())
    assert _max_diff_vs_transformers(art, _dense_embedding_copy(art, tmp_path / "q3_ref")) <= TOL
    art35 = _quantize(
        tiny_qwen3_5,
        tmp_path / "q35",
        {"int4": (["Linear"], 4, 128), "int8": (["re:.*lm_head$"], 8, 128)},
        ignore=["re:.*in_proj_a$", "re:.*in_proj_b$"],
    )
    assert _max_diff_vs_transformers(art35, art35) <= TOL
    assert load_model(art35).mtp is not None  # mtp.* (dense, untouched by llmcompressor) still loads


def test_bf16_packed_weights_match_plain(tiny_qwen3):
    """bf16 on CPU repacks Linears for oneDNN (cpu_pack.py); same logits as the plain bf16 path, up to bf16 rounding."""
    packed, plain = (
        load_model(tiny_qwen3, dtype=torch.bfloat16),
        load_model(tiny_qwen3, dtype=torch.bfloat16, pack=False),
    )
    if not any(type(mod).__name__ == "PackedLinear" for mod in packed.modules()):
        pytest.skip("oneDNN weight packing is not available in this torch build")
    toks = _tokens(packed.config.vocab_size, 16)
    a, b = packed(toks, packed.new_cache(1, 16)), plain(toks, plain.new_cache(1, 16))
    assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_kvarn_store_plugs_into_cache(tiny_qwen3):
    """A qconv.kv scheme (KVarN) behind the KVStore hook: prefill + decode + rollback run and stay near dense."""
    m = load_model(tiny_qwen3)
    toks = _tokens(m.config.vocab_size, 300)
    dense = m(toks, m.new_cache(1, 320))
    cache = m.new_cache(1, 320, kv_scheme="kvarn_k4v4_g64")
    got = torch.cat([m(toks[:, :200], cache), m(toks[:, 200:], cache)], dim=1)
    cache.rollback([0], [250])
    again = m(toks[:, 250:260], cache)
    scale = dense.abs().max().item()
    assert 0 < (got - dense).abs().max().item() < 0.25 * scale
    assert (again - got[:, 250:260]).abs().max().item() <= TOL


def test_packing_only_where_onednn_runs_bf16(monkeypatch):
    """An AVX2-only CPU has oneDNN but not its bf16 linear path (the reorder raises): no packing there."""
    from qconv.engine import cpu_pack

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_pack.packing_available(cpu, torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_pack.packing_available(cpu, torch.bfloat16) == torch.backends.mkldnn.is_available()
    assert not cpu_pack.packing_available(cpu, torch.float32)
