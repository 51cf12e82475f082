"""The building blocks of our engine's models (norm, MLP, rope, attention with its options, decoder block) and the
decoder-only Transformer shell a family file builds on. Fused q/k/v and gate/up projections: fewer, larger matmuls
per decode step. Plain torch: the engine's per-slot cache is reached through the `StepCache` Protocol below."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qconv.errors import QconvError
from qconv.models.config import EngineConfig


class KVRows(Protocol):
    """Where full-attention K/V rows live (qconv.engine.cache.KVStore)."""

    def write(self, layer: int, slots: list[int], starts: list[int], k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class StepCache(Protocol):
    """What a forward reads and writes of the engine's per-slot cache (qconv.engine.cache.ModelCache)."""

    max_len: int
    lengths: torch.Tensor
    kv: KVRows | None
    conv: list[torch.Tensor]  # per linear layer: [max_batch, C, K-1]
    rec: list[torch.Tensor]  # per linear layer: [max_batch, Hv, Dk, Dv] fp32
    max_rollback: int
    mtp: StepCache | None
    records: dict

    def record_gdn(self, slots: list[int], starts: list[int], T: int, stash: dict[int, tuple]) -> None: ...


class CacheFactory(Protocol):
    """Makes the cache of a model (the engine's ModelCache.create); `kv_layers`: that many attention layers alone."""

    def __call__(
        self,
        c: EngineConfig,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype,
        device=None,
        kv_scheme: str = "bf16",
        kv_layers: int | None = None,
    ) -> StepCache: ...


class RMSNorm(nn.Module):
    """One norm for every family: qwen3_5's (1 + w) offset is folded into the weight at load time."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class Step:
    """What every layer of one forward shares: which slots, where each row starts, rope tables, attention mask."""

    cache: StepCache
    slots: list[int]
    starts: list[int]
    T: int
    length: int  # keys to attend over after this step's write (max over rows)
    cos: torch.Tensor  # [B, T, rotary_dim]
    sin: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, T, length] bool, None when plain causal over the whole history works
    gdn: dict[int, tuple] = field(default_factory=dict)  # linear layer -> what rollback needs (cache.record_gdn)

    @classmethod
    def begin(cls, cfg: EngineConfig, cache: StepCache, slots, B: int, T: int, device, dtype) -> Step:
        slots = list(range(B)) if slots is None else [int(s) for s in slots]
        starts = [int(cache.lengths[s]) for s in slots]
        length = max(starts) + T
        if length > cache.max_len:
            raise QconvError(
                f"sequence of {length} tokens exceeds the cache's max_len {cache.max_len}",
                fix="create the cache with a larger max_len",
            )
        pos = positions(starts, T, device)
        cos, sin = rope_tables(pos, cfg.inv_freq, cfg.rope_scaling, dtype)
        mask = None
        if T > 1 or len(set(starts)) > 1:
            keys = torch.arange(length, device=device)
            mask = (keys[None, None, :] <= pos[..., None])[:, None]
        return cls(cache, slots, starts, T, length, cos, sin, mask)

    def end(self) -> None:
        for s in self.slots:
            self.cache.lengths[s] += self.T
            self.cache.records.pop(s, None)  # an older forward's GDN record no longer describes this slot
        if self.gdn:
            self.cache.record_gdn(self.slots, self.starts, self.T, self.gdn)


def positions(starts: list[int], T: int, device) -> torch.Tensor:
    """[B, T] position of each new token: row b continues from starts[b]."""
    return torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, rotary_dim] (rotate-half layout) at positions `pos` [B, T]."""
    freqs = pos[..., None].float() * inv_freq.to(pos.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate(x: torch.Tensor, st: Step) -> torch.Tensor:
    """RoPE on the first rotary_dim channels of x [B, T, H, D] (rotate-half layout)."""
    cos, sin = st.cos[:, :, None], st.sin[:, :, None]
    rd = cos.shape[-1]
    xr = x[..., :rd]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if rd == x.shape[-1] else torch.cat([out, x[..., rd:]], dim=-1)


class Attention(nn.Module):
    """GQA attention; options: q/k/v bias (qwen2), q/k RMSNorm (qwen3), sigmoid output gate from q_proj (qwen3_5)."""

    def __init__(self, cfg: EngineConfig, kv_index: int):
        super().__init__()
        self.kv_index = kv_index
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_size = self.nh * self.hd * (2 if self.gated else 1)
        self.kv_size = self.nkv * self.hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale

    def forward(self, x: torch.Tensor, st: Step) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:  # per head: [query (hd), gate (hd)]
            q, gate = q.view(B, T, self.nh, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.nh * self.hd)
        v = v.view(B, T, self.nkv, self.hd)
        if self.q_norm is None and gate is None:  # q and k are adjacent in the fused output: rotate them at once
            q, k = rotate(qkv[..., : self.q_size + self.kv_size].view(B, T, -1, self.hd), st).split(
                [self.nh, self.nkv], dim=2
            )
        else:
            q, k = q.reshape(B, T, self.nh, self.hd), k.view(B, T, self.nkv, self.hd)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q, st), rotate(k, st)
        kv = st.cache.kv
        kv.write(self.kv_index, st.slots, st.starts, k, v)
        keys, values = kv.read(self.kv_index, st.slots, st.length)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=st.mask, scale=self.scale, enable_gqa=self.nh != self.nkv
        )
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class Block(nn.Module):
    def __init__(self, cfg: EngineConfig, mixer: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mixer = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, st: Step) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), st)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A decoder of attention blocks (the llama family's model; a family file overrides `make_mixer`, `make_block`,
    `embed`, `layer_steps` or `logits`). forward() appends tokens to cache slots and returns float32 logits.
    `make_cache`: the engine's cache constructor."""

    def __init__(self, cfg: EngineConfig, make_cache: CacheFactory):
        super().__init__()
        self.config = cfg
        self.make_cache = make_cache
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied_head: nn.Module | None = None  # a packed copy of the tied embedding (cpu_pack.py)
        self.mtp = None

    def make_block(self, cfg: EngineConfig, i: int) -> nn.Module:
        return Block(cfg, self.make_mixer(cfg, i))

    def make_mixer(self, cfg: EngineConfig, i: int) -> nn.Module:
        return Attention(cfg, cfg.kv_layers.index(i))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def layer_steps(self, st: Step) -> list[Step]:
        """The Step each layer runs with (one shared by all here; a family with sliding-window layers gives them
        their own rope tables and windowed mask)."""
        return [st] * len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, max_batch: int, max_len: int, kv_scheme: str = "bf16") -> StepCache:
        cache = self.make_cache(self.config, max_batch, max_len, self.dtype, self.device, kv_scheme)
        if self.mtp is not None:
            cache.mtp = self.mtp.new_cache(max_batch, max_len, kv_scheme)
        return cache

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(h).float()
        if self.tied_head is not None:
            return self.tied_head(h).float()
        return F.linear(h, self.embed_tokens.weight).float()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: StepCache, slots=None, return_hidden: bool = False):
        """tokens [B, T]; row b appends to slot slots[b]. Returns logits [B, T, V] (and the final-norm hidden)."""
        B, T = tokens.shape
        st = Step.begin(self.config, cache, slots, B, T, tokens.device, self.dtype)
        x = self.embed(tokens)
        for layer, layer_st in zip(self.layers, self.layer_steps(st)):
            x = layer(x, layer_st)
        st.end()
        h = self.norm(x)
        return (self.logits(h), h) if return_hidden else self.logits(h)
