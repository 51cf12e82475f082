"""`qconv build --dry-run`: the build's resolved plan without loading weights (shapes come from safetensors headers
or a meta-device model), its device-memory budget, and the selection when the work dir holds scores already."""

from __future__ import annotations

from dataclasses import dataclass

from qconv.build.memplan import DeviceBudget, budget_for
from qconv.build.options import BuildOptions, check_out, recipe_for, work_root
from qconv.build.plan import BuildPlan
from qconv.build.workdir import WorkDir
from qconv.calibrate.select import Selection, select
from qconv.calibrate.sensitivity import Scores
from qconv.convert.layout import layout_model
from qconv.convert.sources import resolve_source


@dataclass
class DryRun:
    plan: BuildPlan
    device_budget: DeviceBudget  # the build's peak device memory per phase
    selection: Selection | None = None  # when scores are cached in the work dir


def dry_run(opts: BuildOptions) -> DryRun:
    """The plan a build of `opts` would follow. When the work dir holds sensitivity scores from an earlier build, the
    upgrades they give are shown too."""
    recipe = recipe_for(opts)
    if opts.out is not None:  # the build's own check, in the build's order: a dry run says what the build will say
        check_out(opts)
    src = resolve_source(opts.model, revision=opts.revision, weights=False)
    plan = BuildPlan.make(opts, recipe, src, layout_model(src.path, src.config, recipe), dry_run=True)
    root = work_root(opts, src.id)
    cached = WorkDir(root).latest("sensitivity") if root.is_dir() else None
    selection = None
    if cached and set(cached["values"]) >= {u.name for u in plan.units}:
        selection = select(
            list(plan.units),
            Scores(**cached),
            plan.budget_bytes,
            budget=plan.budget_label,
            scheme=recipe.selection.scheme,
        )
    return DryRun(plan, budget_for(plan, opts.card), selection)
