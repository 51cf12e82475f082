"""Issue 16, item 4 and issue 32: `selection.budget: auto` is the fit planner's slack for the tightest profile on the
recipe's card, so every profile still fits after the promotion; the 3090 recipe uses it and `--dry-run` on the 27B
config prints the budget, the promotion preview by role and each profile's fit after promotion."""

from __future__ import annotations

import pytest

from tests.cli_helpers import run


def test_parse_auto():
    from qconv.calibrate.select import parse_budget
    from qconv.errors import QconvError

    assert parse_budget("auto", 1000, 700) == 700 and parse_budget(" auto ", 1000, -5) == 0
    with pytest.raises(QconvError, match="auto"):
        parse_budget("auto", 1000)


def test_recipe_accepts_auto_only_as_a_word(tmp_path):
    import yaml

    from qconv.recipes.recipe import load_recipe
    from qconv.recipes.schema import SchemaError

    assert load_recipe("3090").selection.budget == "auto"
    d = load_recipe("3090").to_dict()
    d["selection"]["budget"] = "automatic"
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(SchemaError, match=r"selection\.budget.*auto"):
        load_recipe(str(p))


def test_auto_budget_is_the_tightest_profiles_slack_on_the_27b(config_27b):
    from qconv.build.dryrun import dry_run
    from qconv.build.options import BuildOptions
    from qconv.convert.sources import read_config
    from qconv.kv.plan import build_report, upgrade_headroom

    dr = dry_run(BuildOptions(model=str(config_27b), recipe="3090")).plan
    roles = dr.layout.bytes_by_role()
    vision, mtp = roles.get("vision", {}).get("bytes", 0), roles.get("mtp", {}).get("bytes", 0)
    config = read_config(config_27b)
    left, fit = upgrade_headroom(config, dr.recipe, dr.layout.total_bytes, vision, mtp)
    # The 27B's tightest profile is `long` (fp8 KV at 147,456 tokens), not the default `fast`.
    assert fit.name == "long" and fit.fits and dr.budget_bytes == left > 0
    before = build_report(
        "", config, dr.recipe, dr.layout.total_bytes, vision, mtp, "estimate", "3090", dr.recipe.card.memory_gib
    )
    assert left == min(f.usable - f.need for f in before.profiles)
    # Promoting the whole budget leaves every profile fitting, the tightest with nothing to spare.
    after = build_report(
        "", config, dr.recipe, dr.layout.total_bytes + left, vision, mtp, "estimate", "3090", dr.recipe.card.memory_gib
    )
    assert len(after.profiles) == 4 and all(f.fits for f in after.profiles)
    assert min(f.usable - f.need for f in after.profiles) == 0
    assert "long, the tightest" in dr.budget_note and "reserve" in dr.budget_note


def test_dry_run_prints_budget_promotion_and_fit(config_27b, tmp_path):
    r = run("build", "--recipe", "3090", "--model", config_27b, "--dry-run", "--work-dir", tmp_path / "w")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "upgrade budget auto =" in out
    for role in ("mlp_down", "mlp_gate_up", "gdn_qkvz", "attn_qkv"):
        assert role in out.split("upgrade candidates")[1]
    after = out.split("after promotion")[1:]
    assert len(after) == 4 and all("-> fits" in part and "DOES NOT FIT" not in part for part in after), out


def test_explicit_budget_still_wins(config_27b, tmp_path):
    from qconv.build.dryrun import dry_run
    from qconv.build.options import BuildOptions

    dr = dry_run(BuildOptions(model=str(config_27b), recipe="3090", upgrade_budget="100MB", work_dir=tmp_path)).plan
    assert dr.budget_bytes == 100_000_000 and dr.budget_note == ""


def test_auto_budget_is_capped_by_max_bpw(config_27b, smollm2, tmp_path):
    """selection.max_bpw bounds what `auto` promotes: the 27B (4.88 bpw planned) keeps the card's 0.07 GiB, SmolLM2
    (under 5.2 bpw with its one shared INT8 table) gets what the cap leaves, and a recipe without the cap lets the
    card decide."""
    import json

    import yaml

    from qconv.build.budget import upgrade_budget
    from qconv.convert.layout import layout_model
    from qconv.recipes.recipe import load_recipe

    r = load_recipe("3090")
    assert r.selection.max_bpw == 5.2
    for model, capped in ((config_27b, False), (smollm2, True)):
        cfg = json.loads((model / "config.json").read_text())
        plan = layout_model(model, cfg, r)
        budget, note = upgrade_budget(r, plan, cfg)
        assert budget > 0 and ("capped" in note) == capped, note
        if capped:
            assert budget == pytest.approx(5.2 * plan.num_parameters / 8 - plan.total_bytes, abs=2)
    d = r.to_dict()
    d["selection"]["max_bpw"] = None
    p = tmp_path / "nocap.yaml"
    p.write_text(yaml.safe_dump(d))
    free = load_recipe(str(p))
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert upgrade_budget(free, layout_model(smollm2, cfg, free), cfg)[0] > 10 * 2**30
    d["selection"]["max_bpw"] = 40
    p.write_text(yaml.safe_dump(d))
    from qconv.errors import QconvError

    with pytest.raises(QconvError, match="max_bpw"):
        load_recipe(str(p))
