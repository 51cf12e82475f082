"""The selection budget: the bytes the build may spend above the uniform layout, from --bpw or the recipe."""

from __future__ import annotations

import logging
import math

from qconv.build.options import BuildOptions
from qconv.calibrate.select import parse_budget
from qconv.convert.layout import Layout
from qconv.disk import human_bytes
from qconv.errors import QconvError
from qconv.kv.plan import upgrade_headroom
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)


def selection_budget(opts: BuildOptions, recipe: Recipe, layout: Layout, config: dict) -> tuple[int, str]:
    """The selection budget in bytes and how it was found: a --bpw target, else the recipe's (upgrade_budget)."""
    if opts.bpw is not None:
        return bpw_budget(opts.bpw, layout), f"upgrade budget from --bpw {opts.bpw:g}"
    return upgrade_budget(recipe, layout, config)


def budget_label(opts: BuildOptions, recipe: Recipe) -> str:
    return f"{opts.bpw} bpw" if opts.bpw is not None else recipe.selection.budget


def upgrade_budget(recipe: Recipe, layout: Layout, config: dict) -> tuple[int, str]:
    """The recipe's selection budget in bytes (spent on int4 g64/g32 steps or INT8 for the most sensitive units),
    and for `auto` the fit it came from (the KV planner's, see qconv.kv.plan.upgrade_headroom)."""
    spec = recipe.selection.budget
    if spec.strip() != "auto":
        return parse_budget(spec, layout.total_bytes), ""
    roles = layout.bytes_by_role()
    left, fit = upgrade_headroom(
        config,
        recipe,
        layout.total_bytes,
        roles.get("vision", {}).get("bytes", 0),
        roles.get("mtp", {}).get("bytes", 0),
    )
    gib, card = 2**30, recipe.card
    on_card = card.memory_gib * gib * fit.profile.gpu_memory_utilization
    note = (
        f"upgrade budget auto = {left / gib:.2f} GiB: {card.name} {card.memory_gib:g} GiB x "
        f"{fit.profile.gpu_memory_utilization:g} - reserve {card.reserve_gib:g} GiB - weights "
        f"{(on_card - card.reserve_gib * gib - fit.usable) / gib:.2f} GiB - profile {fit.name}, the tightest "
        f"({fit.profile.kv_cache} KV at {fit.profile.context_length:,} tokens x {fit.profile.max_num_seqs} "
        f"+ recurrent state) {fit.need / gib:.2f} GiB"
    )
    if (bpw := recipe.selection.max_bpw) is not None and layout.num_parameters:
        cap = max(0, int(bpw * layout.num_parameters / 8) - layout.total_bytes)
        if cap < left:
            note += f"; capped at {human_bytes(cap)} by selection.max_bpw {bpw:g}"
            left = cap
    log.info("%s", note)
    return parse_budget(spec, layout.total_bytes, left), note


def bpw_budget(bpw: float, plan: Layout) -> int:
    """The bytes a bits-per-weight target leaves for 8-bit upgrades over the recipe's plan, counted as the quality
    report counts bpw (artifact tensor bytes x 8 / source parameters)."""
    base = 8 * plan.total_bytes / max(plan.num_parameters, 1)
    if not math.isfinite(bpw) or bpw <= 0 or bpw < base - 1e-9:  # options.check_bpw refused nan/inf earlier
        raise QconvError(
            f"bits-per-weight target {bpw} is below the recipe's uniform plan ({base:.3f} bpw)",
            where="--bpw",
            fix=f"use --bpw >= {base:.2f}, or a recipe with smaller schemes",
        )
    return int(bpw * plan.num_parameters / 8) - plan.total_bytes
