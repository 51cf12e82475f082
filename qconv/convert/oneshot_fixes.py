"""What qconv mends in llm-compressor and compressed-tensors around one `oneshot` run (each through the guarded patch
table of qconv.convert.patches): AutoRound's targets and zero points, rotations of disk-offloaded Linears, the
calibration passes' compute dtype and attention kernel, untying only tied embeddings, row-blocked compression for
saving, AWQ on a torch without an accelerator."""

from __future__ import annotations

import contextlib

from qconv.compute import HALF, upcast
from qconv.convert import patches

COMPRESS_BLOCK_ELEMENTS = 1 << 26  # rows quantized for saving at a time: 256 MB per float32 temporary
SDPA_CALIBRATION = "qconv_calibration_sdpa"  # the attention implementation the calibration passes run under
# keyword arguments with which a model's eager attention computes more than softmax(QK^T * scaling + mask) V
EAGER_ONLY = ("softcap", "s_aux", "sinks", "head_mask", "output_attentions")


@contextlib.contextmanager
def autoround_writes_what_it_tuned():
    """llm-compressor 0.14's AutoRoundModifier matches the recipe's targets against names relative to one decoder
    layer ("mlp.down_proj"), so a target naming one module of the model ("re:^model.layers.3.mlp.down_proj$", how a
    selection names its units) matches nothing there: every unit is tuned with the first config group's scheme and
    writing its scales back fails. Targets are matched by the module's full name instead (the modifier records it
    as `_tmp_name`). It also copies AutoRound's scales back but not its zero points (unsigned, 0..2^b-1), which
    compressed-tensors stores signed: they are written back shifted by 2^(b-1), the same integers."""
    import torch
    from compressed_tensors.utils.match import is_match

    postprocess = patches.current("autoround_postprocess")

    def by_full_name(model, targets, ignore=None, fused=None, warn_on_fail=False):
        for name, module in model.named_modules():
            full = getattr(module, "_tmp_name", name)
            if any(is_match(full, module, t, fused=fused) for t in targets or ()) and not is_match(
                full, module, ignore or [], fused=fused
            ):
                yield name, module

    def with_zero_points(self, model, llmc_registered_qparams):
        for name, module in model.named_modules():
            scheme, zp = getattr(module, "quantization_scheme", None), getattr(module, "zp", None)
            ref = llmc_registered_qparams.get(name, {}).get("weight_zero_point")
            if ref is None or not isinstance(zp, torch.Tensor) or scheme is None or scheme.weights.symmetric:
                continue
            signed = zp.float().round() - 2 ** (scheme.weights.num_bits - 1)
            value = signed.to(ref.dtype).to(ref.device).reshape(ref.shape)
            module.register_parameter("weight_zero_point", torch.nn.Parameter(value, requires_grad=False))
            del module.zp
        return postprocess(self, model, llmc_registered_qparams)

    with patches.swap(autoround_match=by_full_name, autoround_postprocess=with_zero_points):
        yield


@contextlib.contextmanager
def rotations_offloadable():
    """compressed-tensors 0.19's Hadamard factory creates a rotation block on the device its Linear is offloaded to,
    and a streamed build offloads to "disk", which is no torch device: the block (b x b) is created on the CPU
    instead; registering it on the Linear then offloads it like the Linear's own weights."""
    offloaded = patches.current("transform_offloaded_device")

    def on_a_device(module, default=None):
        device = offloaded(module, default)
        return "cpu" if device == "disk" else device

    with patches.swap(transform_offloaded_device=on_a_device):
        yield


@contextlib.contextmanager
def calibrating_in(model, dtype):
    """GPTQ's calibration passes in `dtype` (float32 where a CPU emulates bf16: several times faster there), the
    model saved in its own dtypes after: the half parameters it had go back by name (GPTQ replaces some), and the
    quantization scales llmcompressor made beside them take that half dtype too, as a half-precision run makes
    them. A disk-offloaded (streamed) model computes in its own dtype."""
    import torch

    half = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype in HALF}
    if dtype in HALF or not half or any(t.device.type == "meta" for t in model.parameters()):
        yield
        return
    upcast(model, dtype)
    try:
        yield
    finally:
        to = next(iter(half.values()))
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dtype == torch.float32 and (name in half or name.endswith("_scale")):
                t.data = t.data.to(half.get(name, to))


@contextlib.contextmanager
def untie_only_tied():
    """llmcompressor unties the embeddings (clones both tables) whenever a scheme targets one, also when they are
    separate already: for the 27B two 2.5 GB copies in memory, written again to a streamed build's offload folder,
    for the same values. Separate tables are left as they are."""
    untie = patches.current("untie_word_embeddings")

    def only_tied(model):
        i, o = model.get_input_embeddings(), model.get_output_embeddings()
        if i is None or o is None or i.weight is o.weight:
            return untie(model)
        model.config.tie_word_embeddings = False

    with patches.swap(untie_word_embeddings=only_tied):
        yield


@contextlib.contextmanager
def row_blocked_compression(block_elements: int = COMPRESS_BLOCK_ELEMENTS):
    """compressed-tensors quantizes a weight for saving through float32 temporaries of the whole matrix, several
    at once (5 GB each for a 248,320 x 5,120 lm_head), and packs it through int32 ones. With per-row scales
    (channel or group strategy) rows are independent, so blocks of rows are quantized and packed into one output
    instead: the same integers, the same packed words."""
    import torch

    whole, pack = patches.current("naive_quantize"), patches.current("pack_to_int32")

    def blocked_pack(value, num_bits, packed_dim=1):  # packing runs along each row: rows are independent
        step = max(1, block_elements // max(1, value.shape[-1]))
        if value.dim() != 2 or packed_dim != 1 or value.shape[0] <= step:
            return pack(value, num_bits, packed_dim)
        return torch.cat([pack(value[a : a + step], num_bits, 1) for a in range(0, value.shape[0], step)])

    def blocked(x, scale, zero_point, args, dtype=None, global_scale=None):
        step = max(1, block_elements // max(1, x.shape[-1]))
        if x.dim() != 2 or x.shape[0] <= step or args.strategy not in ("channel", "group") or global_scale is not None:
            return whole(x, scale, zero_point, args, dtype, global_scale)
        out = None
        for a in range(0, x.shape[0], step):
            sl = slice(a, a + step)
            q = whole(x[sl], scale[sl], None if zero_point is None else zero_point[sl], args, dtype)
            if out is None:
                out = torch.empty(x.shape, dtype=q.dtype, device=q.device)
            out[sl] = q
        return out

    with patches.swap(naive_quantize=blocked, packed_quantize=blocked, pack_to_int32=blocked_pack):
        yield


@contextlib.contextmanager
def cpu_awq():
    """llmcompressor 0.14's AWQ pins its cached activations for faster host-to-device copies, which raises "Cannot
    access accelerator device" on a CPU-only torch; without an accelerator there is nothing to copy to, so skip it."""
    import torch

    if torch.accelerator.is_available():
        yield
        return
    with patches.swap(pin_memory=lambda self, batch_index, input_names=None: None):
        yield


def _is_causal(mask, q_len: int) -> bool:
    """Whether an additive mask is exactly the causal one (no padding, no window): torch's fused kernel then skips
    the blocks above the diagonal instead of adding the mask to them, and gives the same bits."""
    import torch

    if mask.shape[-1] != q_len or mask.shape[-2] != q_len or not mask.is_floating_point():
        return False
    causal = torch.full((q_len, q_len), torch.finfo(mask.dtype).min, dtype=mask.dtype, device=mask.device).triu(1)
    return torch.equal(mask, causal.expand(mask.shape))


def _masked_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What a model's eager attention computes (softmax(QK^T * scaling + mask) V over grouped K/V), through torch's
    fused SDPA with the same additive mask. Anything eager does beyond that (logit soft-capping, attention sinks,
    K and V of two widths, attention weights asked for) goes to the model's own eager function."""
    import sys

    import torch

    own = sys.modules[type(module).__module__].eager_attention_forward
    cfg = getattr(module, "config", None)
    if (
        any(kwargs.get(k) for k in EAGER_ONLY)
        or getattr(cfg, "attn_logit_softcapping", None)
        or getattr(module, "sinks", None) is not None
        or key.shape[-1] != value.shape[-1]
        or query.shape[1] % key.shape[1]
    ):
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    causal = mask is not None and _is_causal(mask, query.shape[-2])
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None if causal else mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def sdpa_calibration():
    """llmcompressor 0.14 forces eager attention while it traces and calibrates, so that every batch gets a mask
    tensor its traced graph can add: eager materializes each head's scores and softmax (seq x seq floats). The same
    mask (transformers' eager mask) with torch's fused SDPA computes the same attention without them (what it
    saves: docs/BENCHMARKS.md)."""
    from compressed_tensors.utils import patch_attr
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(SDPA_CALIBRATION, _masked_sdpa)
    AttentionMaskInterface.register(SDPA_CALIBRATION, eager_mask)

    @contextlib.contextmanager
    def masked_sdpa(model):
        if not isinstance(model, PreTrainedModel):
            yield
            return
        with patch_attr(model.config, "_attn_implementation", SDPA_CALIBRATION):
            yield

    with patches.swap(eager_attention=masked_sdpa):
        yield
