"""Per-slot caches: the full-attention KV store (an interface, so qconv.kv's packed stores plug in) and the
Gated-DeltaNet conv/recurrent state. A recurrent state cannot be rolled back by cutting a length, so each forward
records, per slot, the state at the start of its last `max_rollback` tokens and their projected inputs; rollback
replays the kept prefix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from qconv.errors import QconvError
from qconv.kv import get_kv_scheme
from qconv.models.config import EngineConfig
from qconv.models.gdn import recurrent_gated_delta


class KVStore(Protocol):
    """Where full-attention K/V rows live. `read` returns [B, H, length, D] in the compute dtype."""

    def write(self, layer: int, slots: list[int], starts: list[int], k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def truncate(self, slots: list[int], n_keep: list[int]) -> None: ...


class DenseKV:
    """Unquantized ("bf16": the model's own dtype) preallocated [max_batch, H, max_len, D] tensors per layer."""

    def __init__(
        self, layers: int, max_batch: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype, device=None
    ):
        shape = (max_batch, heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def write(self, layer, slots, starts, k, v):
        """k, v: [B, T, H, D] for rows appended at starts[b] of slots[b]."""
        T = k.shape[1]
        for b, (s, p) in enumerate(zip(slots, starts)):
            self.k[layer][s, :, p : p + T] = k[b].transpose(0, 1)
            self.v[layer][s, :, p : p + T] = v[b].transpose(0, 1)

    def read(self, layer, slots, length):
        kc, vc = self.k[layer], self.v[layer]
        s0 = slots[0]
        if slots == list(range(s0, s0 + len(slots))):  # contiguous: a view, no copy
            return kc[s0 : s0 + len(slots), :, :length], vc[s0 : s0 + len(slots), :, :length]
        idx = torch.tensor(slots, device=kc.device)
        return kc[idx, :, :length], vc[idx, :, :length]

    def truncate(self, slots, n_keep):  # dense rows past the length are simply overwritten later
        return None


def make_kv_store(
    scheme: str, layers: int, max_batch: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype, device=None
) -> KVStore | None:
    """bf16 (unquantized): dense tensors; any other scheme: the packed store of qconv.kv's registry, the same
    codec `qconv eval --kv` measures."""
    if layers == 0:
        return None
    if scheme == "bf16":
        return DenseKV(layers, max_batch, max_len, heads, head_dim, dtype, device)
    return get_kv_scheme(scheme).new_store(
        layers=layers, max_batch=max_batch, max_len=max_len, heads=heads, head_dim=head_dim, dtype=dtype, device=device
    )


@dataclass
class GDNRecord:
    """What one forward left behind for one slot: states at token `start`, and the inputs of tokens start.. ."""

    start: int
    n: int  # tokens recorded after start
    conv_win: list[torch.Tensor]  # per linear layer: [C, K-1+n] conv inputs from the snapshot on
    state0: list[torch.Tensor]  # per linear layer: [Hv, Dk, Dv] recurrent state at `start`
    qkvgb: list[tuple[torch.Tensor, ...]]  # per linear layer: q, k [Hv, n, Dk], v [Hv, n, Dv], g, beta [Hv, n]


@dataclass
class ModelCache:
    """All per-slot decoding state of one model. `lengths` live on the CPU: they steer Python-side slicing."""

    max_batch: int
    max_len: int
    lengths: torch.Tensor
    kv: KVStore | None = None
    conv: list[torch.Tensor] = field(default_factory=list)  # per linear layer: [max_batch, C, K-1]
    rec: list[torch.Tensor] = field(default_factory=list)  # per linear layer: [max_batch, Hv, Dk, Dv] fp32
    max_rollback: int = 64  # GDN tokens of the last forward that rollback can return into
    mtp: ModelCache | None = None  # the MTP head's own cache (qwen3_5), fed by the speculative driver
    records: dict[int, GDNRecord] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        c: EngineConfig,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype,
        device=None,
        kv_scheme: str = "bf16",
        kv_layers: int | None = None,
    ) -> ModelCache:
        """The cache of a model with config `c`; `kv_layers` set: that many attention layers alone (the MTP head)."""
        gdn = 0 if kv_layers is not None else len(c.linear_layers)
        kv_layers = len(c.kv_layers) if kv_layers is None else kv_layers
        kv = make_kv_store(kv_scheme, kv_layers, max_batch, max_len, c.num_kv_heads, c.head_dim, dtype, device)
        conv: list[torch.Tensor] = []
        rec: list[torch.Tensor] = []
        if gdn:
            state = c.linear_state  # its shapes come from the model's Family
            if state is None:
                raise QconvError(
                    f"the model has {gdn} linear-attention layers but its family ({c.family}) gives no linear_state",
                    where=f"qconv/models/{c.family}.py",
                    fix="set the Family's linear_state to the per-sequence state shapes of its linear layers",
                )
            conv = [torch.zeros(max_batch, *state.conv, dtype=dtype, device=device) for _ in range(gdn)]
            rec = [torch.zeros(max_batch, *state.recurrent, dtype=torch.float32, device=device) for _ in range(gdn)]
        return cls(max_batch, max_len, torch.zeros(max_batch, dtype=torch.long), kv, conv, rec)

    def reset(self, slots: list[int]) -> None:
        """Free slots: length 0, zero recurrent state (the MTP cache's slots too)."""
        for s in slots:
            self.lengths[s] = 0
            self.records.pop(s, None)
            for c in self.conv + self.rec:
                c[s].zero_()
        if self.kv is not None:
            self.kv.truncate(slots, [0] * len(slots))
        if self.mtp is not None:
            self.mtp.reset(slots)

    def rollback(self, slots: list[int], n_keep: list[int]) -> None:
        """Keep only the first n_keep tokens of each slot (Gated-DeltaNet state: within the last forward's window)."""
        for s, n in zip(slots, n_keep):
            cur = int(self.lengths[s])
            if not 0 <= n <= cur:
                raise QconvError(f"rollback of slot {s} to {n} tokens, but it holds {cur}")
            if n < cur and self.conv:
                self._rollback_gdn(s, n)
            self.lengths[s] = n
        if self.kv is not None:
            self.kv.truncate(slots, n_keep)

    def record_gdn(self, slots: list[int], starts: list[int], T: int, stash: dict[int, tuple]) -> None:
        """Keep what the GDN layers stashed during one forward (qconv.models.qwen3_5) as each slot's rollback record."""
        layers = [stash[i] for i in sorted(stash)]
        w = layers[0][2].shape[2]
        for row, (slot, start) in enumerate(zip(slots, starts)):
            self.records[slot] = GDNRecord(
                start=start + T - w,
                n=w,
                conv_win=[rec[0][row] for rec in layers],
                state0=[rec[1][row] for rec in layers],
                qkvgb=[tuple(t[row] for t in rec[2:]) for rec in layers],
            )

    def _rollback_gdn(self, s: int, n: int) -> None:
        r = self.records.get(s)
        if r is None or not r.start <= n <= r.start + r.n:
            lo = "nothing" if r is None else f"{r.start}..{r.start + r.n}"
            raise QconvError(
                f"cannot roll slot {s} back to {n} tokens: the recurrent state can return to {lo}",
                fix=f"roll back only into the last forward's final {self.max_rollback} tokens",
            )
        m = n - r.start
        k1 = self.conv[0].shape[-1]
        for i in range(len(self.conv)):
            self.conv[i][s].copy_(r.conv_win[i][:, m : m + k1])
            q, k, v, g, beta = (x[None, :, :m] for x in r.qkvgb[i])
            _, state = recurrent_gated_delta(q, k, v, g, beta, r.state0[i][None].clone())
            self.rec[i][s].copy_(state[0])
        r.n = m
