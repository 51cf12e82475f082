"""Gated delta rule kernels in plain PyTorch (fp32): the per-token recurrence for decode and short verify blocks,
and the chunked form for prefill. Inputs are [B, H, T, ...], q/k already L2-normalized and q scaled by Dk^-1/2.

Recurrence (state S is [Dk, Dv], a_t = exp(g_t)):
    u_t = beta_t (v_t - a_t S_{t-1}^T k_t);  S_t = a_t S_{t-1} + k_t u_t^T;  o_t = S_t^T q_t
Inside a chunk with start state S0 and cumulative decay G_t = exp(sum_{i<=t} g_i), the u_t solve one unit lower
triangular system (I + A) U = beta V - beta G K S0, A[t,j] = beta_t (k_t.k_j) G_t/G_j (j < t); outputs and the end
state then follow from matmuls, so only the chunk-to-chunk state hand-off is sequential."""

from __future__ import annotations

import torch


def recurrent_gated_delta(q, k, v, g, beta, state):
    """q, k [B,H,T,Dk]; v [B,H,T,Dv]; g, beta [B,H,T]; state [B,H,Dk,Dv] fp32 (updated copy returned)."""
    T = q.shape[2]
    out = v.new_empty(v.shape)
    decay = g.exp()
    for t in range(T):
        state = state * decay[:, :, t, None, None]
        kt = k[:, :, t]
        pred = (kt.unsqueeze(-2) @ state).squeeze(-2)  # [B,H,Dv]
        u = (v[:, :, t] - pred) * beta[:, :, t, None]
        state = state + kt.unsqueeze(-1) * u.unsqueeze(-2)
        out[:, :, t] = (q[:, :, t].unsqueeze(-2) @ state).squeeze(-2)
    return out, state


def chunk_gated_delta(q, k, v, g, beta, state, chunk: int = 64):
    """Same contract as recurrent_gated_delta, O(T/chunk) sequential steps."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    cum = g.cumsum(-1)  # log G_t inside each chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    rel = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # G_t / G_j, j <= t
    kb = k * beta.unsqueeze(-1)
    A = (kb @ k.transpose(-1, -2)) * rel  # diagonal ignored by the unit-triangular solve
    U0 = torch.linalg.solve_triangular(A, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * rel  # causal read weights within the chunk
    q_dec = q * cum.exp().unsqueeze(-1)  # reads of the start state decay by G_t
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decay to the chunk end
    end_decay = cum[..., -1].exp()
    out = v.new_empty(B, H, n, chunk, Dv)
    for c in range(n):
        u = U0[:, :, c] - W[:, :, c] @ state
        out[:, :, c] = q_dec[:, :, c] @ state + QK[:, :, c] @ u
        state = state * end_decay[:, :, c, None, None] + k_dec[:, :, c].transpose(-1, -2) @ u
    return out.reshape(B, H, n * chunk, Dv)[:, :, :T], state


def gated_delta(q, k, v, g, beta, state, recurrent_max: int = 16):
    """Per-token recurrence for short inputs (decode, verify blocks), chunked form for prefill."""
    if q.shape[2] <= recurrent_max:
        return recurrent_gated_delta(q, k, v, g, beta, state)
    return chunk_gated_delta(q, k, v, g, beta, state)
