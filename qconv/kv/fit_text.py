"""The memory-fit planner's words: the `qconv kv plan` report, the per-profile lines of `qconv build --dry-run`,
and the refusal that says what would fit."""

from __future__ import annotations

from qconv.errors import QconvError
from qconv.kv.plan import COMPARE, GIB, FitReport, build_report
from qconv.kv.schemes import GPU_RUNTIME, NO_GPU_RUNTIME, get_kv_scheme
from qconv.recipes.recipe import Recipe


def profile_fit_lines(
    config: dict, recipe: Recipe, total_bytes: int, vision_bytes: int = 0, mtp_bytes: int = 0
) -> list[str]:
    """One line per profile on the recipe's own card, for `qconv build --dry-run`."""
    r = build_report(
        "", config, recipe, total_bytes, vision_bytes, mtp_bytes, "estimate", recipe.card.name, recipe.card.memory_gib
    )
    return [
        f"profile {f.name} on {r.card} ({r.card_gib:g} GiB): {f.profile.kv_cache} KV at "
        f"{f.profile.context_length:,} tokens needs {_gib(f.need)} of {_gib(f.usable)} left for KV + state -> "
        + (f"fits ({f.runtime})" if f.fits else "DOES NOT FIT" if f.runtime else f"NOT SERVABLE: {NO_GPU_RUNTIME}")
        + f"; one sequence reaches {f.max_context[f.profile.kv_cache]:,} tokens"
        for f in r.profiles
    ]


def _gib(b: int | float) -> str:
    return f"{b / GIB:.2f} GiB"


def render(r: FitReport) -> str:
    d, w = r.dims, r.weights
    bf16 = d.full_layers * d.kv_heads * get_kv_scheme("bf16").bytes_per_token_per_head(d.head_dim)
    lines = [
        f"model: {r.model}",
        f"card: {r.card}, {r.card_gib:g} GiB; activation/workspace reserve {r.reserve_gib:g} GiB",
        f"weights ({w.source}): {w.total:,} B ({_gib(w.total)}) in files; on the GPU {w.resident:,} B "
        f"({_gib(w.resident)}): vision tower ({_gib(w.vision)}) left out, MTP drafter ({_gib(w.mtp)}) kept",
        f"attention: {d.full_layers} full-attention layers x {d.kv_heads} KV heads x head_dim {d.head_dim}"
        + (f"; {d.linear_layers} Gated-DeltaNet layers" if d.linear_layers else "")
        + (f"; {d.sliding_layers} sliding-window layers (window {d.sliding_window:,})" if d.sliding_layers else ""),
        "KV bytes per token (full-attention layers, K+V):",
    ]
    listed = (
        *COMPARE,
        *(f.profile.kv_cache for f in r.profiles),
        "kvarn_k4v4_g256",
        "kvarn_k4v2_g256",
        "int4_g32",
        "kivi_k4v4_g128",
    )
    for s in dict.fromkeys(listed):
        sch = get_kv_scheme(s)
        b = d.full_layers * d.kv_heads * sch.bytes_per_token_per_head(d.head_dim)
        lines.append(
            f"  {s:<17} {b:>10,.0f} B  ({sch.bits_per_element(d.head_dim):.3f} bits/elem, "
            f"{bf16 / b:.2f}x smaller than bf16)"
        )
    if d.linear_layers:
        lines.append(
            f"GDN state per sequence slot: {d.linear_layers} layers x (conv {d.conv_elems:,} elems x 2 B + "
            f"recurrent {d.recurrent_elems:,} elems x 4 B fp32 or 2 B fp16)"
        )
    lines.append(f"speculative: {r.speculative}")
    for f in r.profiles:
        p = f.profile
        lines += [
            "",
            f"profile {f.name}: {p.kv_cache} KV, context {p.context_length:,}, max_num_seqs {p.max_num_seqs}, "
            f"gpu_memory_utilization {p.gpu_memory_utilization}, GDN state {p.mamba_ssm_cache_dtype}",
            f"  runs on: {f.runtime or NO_GPU_RUNTIME}",
            f"  usable for KV + state: {_gib(f.usable)}"
            + (f" (after {_gib(f.work_bytes)} of KV-cache work memory)" if f.work_bytes else ""),
            f"  KV {f.kv_per_token:,} B/token"
            + (f" + MTP drafter {f.draft_kv_per_token:,} B/token" if f.draft_kv_per_token else "")
            + (
                f" + sliding-window layers {f.window_kv_per_token:,} B/token for at most {f.window_tokens:,} tokens"
                if f.window_kv_per_token
                else ""
            )
            + (f" + {_gib(f.kv_exact_bytes)} exact fp16 tokens" if f.kv_exact_bytes else "")
            + (
                f"; GDN state {f.state_bytes:,} B x {f.state_slots} slots = {_gib(f.state_bytes * f.state_slots)}"
                if f.state_bytes
                else ""
            )
            + (f"; draft block {f.draft_block} tokens" if f.draft_block else ""),
            f"  per sequence at {p.context_length:,} tokens: {_gib(f.per_seq(p.context_length))}; "
            f"needs {_gib(f.need)} for {p.max_num_seqs} -> "
            + ("FITS" if f.fits else "DOES NOT FIT" if f.runtime else "NOT SERVABLE on the card")
            + f" (headroom {_gib(f.usable - f.need)})",
            f"  max context for one sequence: {f.max_context[p.kv_cache]:,} tokens"
            + (f" (model limit {d.max_position:,})" if d.max_position else "")
            + f"; max sequences at {p.context_length:,}: {f.max_seqs}",
            "  one sequence, same settings, other KV caches: "
            + ", ".join(f"{s} {n:,} ({n / max(1, f.max_context['bf16']):.2f}x bf16)" for s, n in f.max_context.items()),
        ]
    return "\n".join(lines)


def check_fits(r: FitReport) -> None:
    """Refuse (exit 2) when a profile does not fit, saying what would."""
    bad = [f for f in r.profiles if not f.fits]
    if not bad:
        return
    if none := [f for f in bad if f.runtime is None]:
        f = none[0]
        served = ", ".join(k for k in GPU_RUNTIME)
        raise QconvError(
            f"profile {f.name}: {f.profile.kv_cache} KV cache on {r.card}: {NO_GPU_RUNTIME}",
            where="--profile",
            fix=f"use a KV cache a GPU runtime serves ({served})",
        )
    what = "; ".join(f"{f.name} needs {_gib(f.need)} for KV + state, {_gib(max(0, f.usable))} is left" for f in bad)
    if bad[0].usable <= 0:
        fix = (
            f"the weights ({_gib(r.weights.resident)}) and the {r.reserve_gib:g} GiB reserve already fill the card: "
            "use a larger card (--card / --card-gib) or a smaller recipe"
        )
    else:
        best = max(bad[0].max_context.items(), key=lambda kv: kv[1])
        fix = (
            f"lower context_length to at most {bad[0].max_context[bad[0].profile.kv_cache]:,}, use a smaller KV "
            f"cache ({best[0]} reaches {best[1]:,} tokens), or a larger card"
        )
    raise QconvError(f"profile does not fit on {r.card} ({r.card_gib:g} GiB): {what}", where="--profile", fix=fix)
