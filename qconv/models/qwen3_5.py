"""The qwen3_5 family (Qwen3.5 / Qwen3-Next style hybrid): Gated-DeltaNet layers interleaved with gated full
attention, plus the MTP head; its FAMILY record at the end.

MTP (as vLLM's qwen3_next_mtp computes it): x = fc([norm_e(embed(token t+1)), norm_h(hidden t)]) -> one gated
full-attention block at position t -> final norm -> the target's lm_head. `hidden` is the target's final-norm
hidden state; the head's own output hidden feeds the next chained draft."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from qconv.models.blocks import Attention, Block, CacheFactory, RMSNorm, Step, StepCache, Transformer
from qconv.models.config import EngineConfig
from qconv.models.family import Family, Fused, LinearState, interleaved_layer_types
from qconv.models.gdn import gated_delta
from qconv.models.llama import ATTENTION_ROLES, LLAMA_FUSED, LLAMA_VLLM_ROLES


def _take(buf: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """A copy of the slots' rows (a copy, so later in-place cache writes cannot change it)."""
    return buf.index_select(0, torch.tensor(slots, device=buf.device))


def _put(buf: torch.Tensor, slots: list[int], val: torch.Tensor) -> None:
    buf.index_copy_(0, torch.tensor(slots, device=buf.device), val.to(buf.dtype))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer: causal depthwise conv over fused q/k/v, then the gated delta rule per v-head."""

    def __init__(self, cfg: EngineConfig, state_index: int):
        super().__init__()
        self.state_index = state_index
        self.hk, self.hv = cfg.linear_num_k_heads, cfg.linear_num_v_heads
        self.dk, self.dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.conv_kernel
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = RMSNorm(self.dv, cfg.rms_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, st: Step) -> torch.Tensor:
        B, T, _ = x.shape
        cache, li = st.cache, self.state_index
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        xcat = torch.cat([_take(cache.conv[li], st.slots), qkv.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        _put(cache.conv[li], st.slots, xcat[..., T:])
        conv = F.silu(F.conv1d(xcat, self.conv_weight[:, None, :], groups=self.conv_dim)).transpose(1, 2)
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.hv // self.hk
        q = q.reshape(B, T, self.hk, self.dk).repeat_interleave(rep, dim=2)
        k = k.reshape(B, T, self.hk, self.dk).repeat_interleave(rep, dim=2)
        v = v.reshape(B, T, self.hv, self.dv)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, H, T, D]
        q, k = _l2norm(q) * self.dk**-0.5, _l2norm(k)
        beta = b.float().sigmoid().transpose(1, 2)  # [B, H, T]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).transpose(1, 2)
        state = _take(cache.rec[li], st.slots)
        w = min(T, cache.max_rollback)
        if w < T:  # run the part rollback can never return into separately, so the window's start state exists
            out_head, state = gated_delta(
                q[:, :, : T - w], k[:, :, : T - w], v[:, :, : T - w], g[:, :, : T - w], beta[:, :, : T - w], state
            )
        tail = (q[:, :, T - w :], k[:, :, T - w :], v[:, :, T - w :], g[:, :, T - w :], beta[:, :, T - w :])
        if w > 0:
            st.gdn[li] = (xcat[..., T - w :], state) + tail
        out, state = gated_delta(*tail, state)
        if w < T:
            out = torch.cat([out_head, out], dim=2)
        _put(cache.rec[li], st.slots, state)
        out = self.norm(out.transpose(1, 2).to(x.dtype)) * F.silu(z.reshape(B, T, self.hv, self.dv))
        return self.out_proj(out.reshape(B, T, self.value_dim))


class MTPHead(nn.Module):
    """qwen3_5's multi-token-prediction layer; shares the target's embeddings and lm_head."""

    def __init__(self, cfg: EngineConfig, target: Transformer):
        super().__init__()
        self.config = cfg
        self._target = [target]  # a list, so the target is not registered as a submodule
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.block = Block(cfg, Attention(cfg, 0))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def new_cache(self, max_batch: int, max_len: int, kv_scheme: str = "bf16") -> StepCache:
        t = self._target[0]
        return t.make_cache(self.config, max_batch, max_len, t.dtype, t.device, kv_scheme, kv_layers=1)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: StepCache, slots=None):
        """hidden [B, T, H] (target positions p..p+T-1), next_tokens [B, T] (tokens p+1..p+T) -> logits, hidden.

        `cache` is the MTP's own cache (or the target's ModelCache, whose `.mtp` is then used); its length per slot
        is the position of the first hidden row."""
        cache = cache.mtp if cache.mtp is not None else cache
        target = self._target[0]
        B, T = next_tokens.shape
        st = Step.begin(self.config, cache, slots, B, T, next_tokens.device, target.dtype)
        e = self.pre_fc_norm_embedding(target.embed_tokens(next_tokens))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(target.dtype))], dim=-1))
        x = self.block(x, st)
        st.end()
        h = self.norm(x)
        return target.logits(h), h


class Qwen35Transformer(Transformer):
    def __init__(self, cfg: EngineConfig, make_cache: CacheFactory):
        super().__init__(cfg, make_cache)
        self.mtp = MTPHead(cfg, self) if cfg.has_mtp else None

    def make_mixer(self, cfg: EngineConfig, i: int) -> nn.Module:
        if cfg.layer_types[i] == "linear_attention":
            return GatedDeltaNet(cfg, cfg.linear_layers.index(i))
        return Attention(cfg, cfg.kv_layers.index(i))


def linear_state(tc: dict) -> LinearState:
    """A Gated-DeltaNet layer's per-sequence state: the conv window over q/k/v and the [Hv, Dk, Dv] matrix."""
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    conv = (2 * nk * dk + nv * dv, tc["linear_conv_kernel_dim"] - 1)
    return LinearState(conv, (nv, dk, dv), tc.get("mamba_ssm_dtype", "float32"))


FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    role_patterns=(
        ("mtp", r"^mtp\."),
        ("vision", r"(^|\.)(visual|vision_tower|vision_model)\."),
        *ATTENTION_ROLES,
        ("gdn_qkvz", r"\.linear_attn\.in_proj_(qkv|z)$"),
        ("gdn_ab", r"\.linear_attn\.in_proj_[ab]$"),
        ("gdn_out", r"\.linear_attn\.out_proj$"),
    ),
    fused_roles=frozenset({"attn_qkv", "mlp_gate_up", "gdn_qkvz", "gdn_ab"}),
    fused=(*LLAMA_FUSED, Fused("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "in_proj_qkvz")),
    transformer=Qwen35Transformer,
    norm_offset=1.0,
    qk_norm=True,
    attn_output_gate=True,
    # configs without `layer_types`: every full_attention_interval-th layer (default 4th) attends, as transformers'
    layer_types=partial(
        interleaved_layer_types, every_key="full_attention_interval", every=4, other="linear_attention"
    ),
    linear_state=linear_state,
    hybrid=True,
    multimodal_archs=("Qwen3_5ForConditionalGeneration",),
    vllm_role_modules={
        **LLAMA_VLLM_ROLES,
        "gdn_qkvz": r"\.linear_attn\.in_proj_qkvz$",
        "gdn_out": r"\.linear_attn\.out_proj$",
    },
)
