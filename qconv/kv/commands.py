"""CLI verbs of the KV area: `qconv plan` (memory fit per runtime profile)."""

from __future__ import annotations

import click


@click.command("plan")
@click.argument("model", metavar="MODEL_OR_ARTIFACT")
@click.option("--card", default="3090", show_default=True, help="Card name (3090, 4090, 5090, a100-80, h100-80, ...).")
@click.option("--card-gib", type=float, default=None, help="Card memory in GiB (overrides the card table).")
@click.option("--recipe", default=None, help="Recipe name or YAML (default: the artifact's, else 3090).")
@click.option("--profile", default=None, help="Check only this profile (default: all of the recipe's).")
@click.option(
    "--draft-len",
    type=int,
    default=None,
    help="Extra GDN state slots per sequence for speculative decoding (default: num_speculative_tokens).",
)
def plan(model, card, card_gib, recipe, profile, draft_len):
    """What MODEL_OR_ARTIFACT needs on a card: weights, KV bytes per token per scheme, GDN state, max context and
    concurrent sequences per profile. Exits 2 if a profile does not fit."""
    from qconv.kv.fit_text import check_fits, render
    from qconv.kv.plan import plan_fit

    report = plan_fit(model, card=card, card_gib=card_gib, recipe=recipe, profile=profile, draft_len=draft_len)
    click.echo(render(report))
    check_fits(report)


COMMANDS = [plan]
