"""The selection budget (bytes the build may spend above the uniform plan) and the `--dry-run` plan that shows it
without loading weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from qconv.build.memplan import DevicePlan, plan_for
from qconv.build.options import BuildOptions, check_out, recipe_for, use_streaming, work_root
from qconv.build.workdir import WorkDir
from qconv.calibrate.select import Selection, parse_budget, select
from qconv.calibrate.sensitivity import Scores
from qconv.calibrate.units import Unit
from qconv.convert.layout import Plan, bpw_budget, candidate_units, plan_model
from qconv.convert.sources import resolve_source
from qconv.disk import human_bytes
from qconv.kv.plan import int8_headroom
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass
class DryRun:
    plan: Plan
    recipe: Recipe
    config: dict
    selection: Selection | None = None  # when scores are cached in the work dir
    budget_bytes: int = 0
    budget_note: str = ""  # how an `auto` budget was found
    units: list[Unit] | None = None  # candidates (for the by-role preview without scores)
    device_plan: DevicePlan | None = None  # the build's peak device memory per phase


def selection_budget(opts: BuildOptions, recipe: Recipe, plan: Plan, config: dict) -> tuple[int, str]:
    """The selection budget in bytes and how it was found: a --bpw target, else the recipe's (upgrade_budget)."""
    if opts.bpw is not None:
        return bpw_budget(opts.bpw, plan), f"upgrade budget from --bpw {opts.bpw:g}"
    return upgrade_budget(recipe, plan, config)


def budget_label(opts: BuildOptions, recipe: Recipe) -> str:
    return f"{opts.bpw} bpw" if opts.bpw is not None else recipe.selection.budget


def upgrade_budget(recipe: Recipe, plan: Plan, config: dict) -> tuple[int, str]:
    """The recipe's selection budget in bytes (spent on int4 g64/g32 steps or INT8 for the most sensitive units),
    and for `auto` the fit it came from (the KV planner's, see qconv.kv.plan.int8_headroom)."""
    spec = recipe.selection.budget
    if spec.strip() != "auto":
        return parse_budget(spec, plan.total_bytes), ""
    roles = plan.bytes_by_role()
    left, fit = int8_headroom(
        config, recipe, plan.total_bytes, roles.get("vision", {}).get("bytes", 0), roles.get("mtp", {}).get("bytes", 0)
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
    if (bpw := recipe.selection.max_bpw) is not None and plan.num_parameters:
        cap = max(0, int(bpw * plan.num_parameters / 8) - plan.total_bytes)
        if cap < left:
            note += f"; capped at {human_bytes(cap)} by selection.max_bpw {bpw:g}"
            left = cap
    log.info("%s", note)
    return parse_budget(spec, plan.total_bytes, left), note


def dry_run(opts: BuildOptions) -> DryRun:
    """The plan without loading weights: shapes come from safetensors headers or a meta-device model. When the
    work dir holds sensitivity scores from an earlier build, the INT8 selection they give is shown too."""
    recipe = recipe_for(opts)
    if opts.out is not None:  # the build's own check, in the build's order: a dry run says what the build will say
        check_out(opts)
    src = resolve_source(opts.model, revision=opts.revision, weights=False)
    config = src.config
    plan = plan_model(src.path, config, recipe)
    if recipe.quantizer.algorithm == "autoround":
        use_streaming(opts, plan, "autoround")  # the build's refusal, said by the dry run
    selection = None
    budget, note = selection_budget(opts, recipe, plan, config)
    root = work_root(opts, src.id)
    cached = WorkDir(root).latest("sensitivity") if root.is_dir() else None
    units = candidate_units(plan, recipe)
    if cached and set(cached["values"]) >= {u.name for u in units}:
        selection = select(
            units, Scores(**cached), budget, budget=budget_label(opts, recipe), scheme=recipe.selection.scheme
        )
    return DryRun(
        plan, recipe, config, selection, budget, note, units, plan_for(opts, recipe, plan, config, planning=True)
    )
