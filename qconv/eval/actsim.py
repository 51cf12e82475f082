"""W4A8 as a profile serves it, simulated: int8 symmetric per-token dynamic quantization of the inputs of exactly
the linears of the named roles (what Marlin's int8 input path computes on them), so `qconv eval --profile` measures
and gates its quality cost like a KV cache's."""

from __future__ import annotations

import contextlib

import torch

from qconv.recipes.roles import role_of


def quantize_per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with one scale per token (max |x| / 127), back in x's dtype."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-8) / 127
    return ((x.float() / scale).round().clamp(-127, 127) * scale).to(x.dtype)


def linears_of(model: torch.nn.Module, roles: tuple[str, ...]) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and role_of(n) in roles]


@contextlib.contextmanager
def act8_simulation(model: torch.nn.Module, roles: tuple[str, ...]):
    """Within: the named roles' linears see int8 per-token inputs. Nothing when roles is empty."""
    names = set(linears_of(model, roles)) if roles else set()
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: (quantize_per_token_int8(args[0]), *args[1:]))
        for n, m in model.named_modules()
        if n in names
    ]
    try:
        yield len(hooks)
    finally:
        for h in hooks:
            h.remove()
