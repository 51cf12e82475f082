"""CLI verb `qconv build` (and its --dry-run plan printout and summary view)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from qconv.eval.commands import compute_dtype_option


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def print_plan(dr) -> None:
    """The per-role scheme table, size estimate and what is left on the recipe's card."""
    from rich.console import Console
    from rich.table import Table

    from qconv.calibrate.units import module_bytes

    plan, recipe = dr.plan.layout, dr.plan.recipe
    con = Console()
    t = Table(title=f"plan: recipe {recipe.name} on {plan.family} ({plan.num_parameters / 1e9:.3f}B params)")
    for c in ("role", "modules", "params", "scheme", "bytes"):
        t.add_column(c, justify="right" if c in ("modules", "params", "bytes") else "left")
    for role, r in sorted(plan.bytes_by_role().items(), key=lambda kv: -kv[1]["bytes"]):
        t.add_row(
            role, str(r["modules"]), f"{r['params'] / 1e6:.1f}M", ", ".join(sorted(r["schemes"])), _gb(r["bytes"])
        )
    t.add_row("other (norms, conv, ...)", "", "", "bf16", _gb(plan.other_bytes))
    con.print(t)
    notes = [m for m in plan.modules if m.note]
    if notes:
        con.print(f"{len(notes)} modules with notes, e.g.:")
        for m in notes[:6]:
            con.print(f"  {m.name} [{m.shape[0]}x{m.shape[1]}] {m.scheme}: {m.note}")
    for w in plan.warnings[:5]:
        con.print(f"[yellow]warning:[/yellow] {w}")
    # What int8 embeddings buy, against an all-W4A16 build that keeps embed/lm_head bf16.
    emb = [m for m in plan.modules if m.role in ("embed", "lm_head") and m.bits]
    saving = sum(m.shape[0] * m.shape[1] * 2 - module_bytes(m) for m in emb)
    con.print(
        f"estimated artifact size: [bold]{_gb(plan.total_bytes)}[/bold] "
        f"(source {_gb(plan.source_bytes)}, {100 * plan.total_bytes / plan.source_bytes:.1f}%)"
    )
    if saving:
        con.print(
            f"  int8 embed/lm_head save {_gb(saving)} vs bf16: an all-W4A16 build would be "
            f"{_gb(plan.total_bytes + saving)}"
        )
    fits = _profile_fits(dr)
    for line in fits:
        con.print(line)
    if dr.plan.budget_note:
        con.print(dr.plan.budget_note)
    if dr.plan.budget_bytes and dr.selection is None and dr.plan.units:
        promoted = _promotion_preview(dr, con)
        for line in _profile_fits(dr, extra=promoted):
            con.print(f"after promotion (+{_gb(promoted)}): {line}")


def print_device_budget(dp, requested: str) -> None:
    """The per-phase device-memory peaks and projected time; a plan that does not fit exits 2 with the knob."""
    from qconv.convert.device import cuda_available

    for line in dp.lines():
        click.echo(line)
    if dp.device == "cuda" and not cuda_available():
        click.echo(
            f"(a plan for {dp.target}: torch sees no CUDA device here, so `qconv build --device "
            f"{requested}` on this machine would {'be refused' if requested == 'cuda' else 'run on the CPU'})"
        )
    dp.check()


def _promotion_preview(dr, con) -> int:
    """Without sensitivity scores (no weights loaded): per candidate role, what one unit costs to promote and how
    many such units the budget covers; returns the bytes promotion can add at most (min(budget, all units))."""
    from collections import defaultdict

    by_role = defaultdict(list)
    for u in dr.plan.units:
        if not u.refusal:
            by_role[u.role].append(u.top_bytes - u.base_bytes)
    con.print(
        f"upgrade candidates under {_gb(dr.plan.budget_bytes)} (units ranked by the build's sensitivity "
        "proxy per extra byte; shapes only here):"
    )
    for role, extras in sorted(by_role.items(), key=lambda kv: -sum(kv[1])):
        each = max(extras)
        con.print(
            f"  {role:12s} {len(extras):4d} units, +{each / 1e6:.1f} MB each, "
            f"{min(len(extras), dr.plan.budget_bytes // max(each, 1))} affordable alone ({_gb(sum(extras))} for all)"
        )
    refused = [u for u in dr.plan.units if u.refusal]
    if refused:
        con.print(f"  {len(refused)} units refused (e.g. {refused[0].name}: {refused[0].refusal})")
    return min(dr.plan.budget_bytes, sum(sum(v) for v in by_role.values()))


def _profile_fits(dr, extra: int = 0) -> list[str]:
    """Bytes left on the card per profile (weights + `extra` promoted bytes), from the KV/state planner."""
    from qconv.kv.fit_text import profile_fit_lines

    roles = dr.plan.layout.bytes_by_role()
    return profile_fit_lines(
        dr.plan.source.config,
        dr.plan.recipe,
        dr.plan.layout.total_bytes + extra,
        vision_bytes=roles.get("vision", {}).get("bytes", 0),
        mtp_bytes=roles.get("mtp", {}).get("bytes", 0),
    )


@click.command()
@click.option("--model", "-m", required=True, help="Local HF folder, Hugging Face id, or .gguf file.")
@click.option("--recipe", "-r", default="3090", show_default=True, help="Built-in recipe name or a YAML path.")
@click.option("--out", "-o", type=click.Path(path_type=Path), help="Artifact folder to write.")
@click.option("--dataset", "-d", help="Calibration data: .txt/.jsonl/.json/.parquet file or HF dataset id.")
@click.option("--samples", type=int, help="Calibration samples (default: recipe).")
@click.option("--seq-len", type=int, help="Calibration sequence length (default: recipe).")
@click.option("--seed", type=int, help="Seed for calibration sampling (default: recipe).")
@click.option("--revision", help="Hub revision (branch, tag or commit) to pin.")
@click.option("--eval-text", help="Held-out text (file or HF dataset id) for the quality report and gates.")
@click.option(
    "--eval-tokens",
    type=click.IntRange(min=1),
    help="Score at most this many tokens of --eval-text, in whole windows (default: the recipe's "
    "quality.max_tokens, 8,192 for 3090). Recorded in qconv.json.",
)
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@click.option("--no-gates", is_flag=True, help="Keep a build whose quality gates fail (marked failed).")
@click.option("--dry-run", is_flag=True, help="Print the plan and size estimate; load no weights.")
@click.option(
    "--work-dir", type=click.Path(path_type=Path), help="Stage cache (default: QCONV_HOME/work/<source hash>)."
)
@click.option("--fresh", is_flag=True, help="Ignore cached stages in the work dir.")
@click.option("--stream/--no-stream", default=None, help="Stream layers from safetensors (default: when RAM is short).")
@click.option(
    "--upgrade-budget",
    "--int8-budget",
    "upgrade_budget",
    help="Bytes the selection may spend upgrading the most sensitive 4-bit units (to int4 g64/g32 steps or "
    "INT8), overrides the recipe (0, 300MB, 1.5GiB, 5%). --int8-budget is its old name, kept as an "
    "alias.",
)
@click.option(
    "--bpw",
    type=float,
    help="Bits-per-weight target (as the quality report counts them): the most "
    "sensitive units per byte go to the selection's 8-bit scheme until it is reached.",
)
@click.option(
    "--sensitivity",
    type=click.Choice(["proxy", "kld"]),
    default="proxy",
    show_default=True,
    help="Unit sensitivity: per-layer proxy, or model-level KLD (one forward pass per unit).",
)
@click.option(
    "--reference",
    type=click.Path(path_type=Path),
    help="For a quantized --model: the full-precision original the quality report compares against, or "
    "a reference cache folder computed from it (QCONV_HOME/reference/KEY, named in a report.json) "
    "(default: the quantized checkpoint itself).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="Where each layer is calibrated and quantized and the quality report runs (auto: CUDA when torch sees a GPU).",
)
@compute_dtype_option(
    "the build's forwards (self-generated calibration, sensitivity, GPTQ's calibration passes, the quality report)",
    "Recorded in qconv.json; the weights are the same bf16 numbers either way.",
)
@click.option(
    "--cpu-isa",
    type=click.Choice(["native", "avx2"]),
    default="native",
    show_default=True,
    help="avx2: compute with AVX2 kernels on any x86 CPU (bf16 emulated, so auto computes in float32), so that an "
    "AVX2-only CPU rebuilds the artifact bit for bit. Recorded in qconv.json as build.cpu_isa.",
)
@click.option(
    "--card",
    help="--dry-run: the card the device-memory plan is for (3090, 4090, a100-80, ...; default: "
    "the recipe's). A build measures the GPU it runs on.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show library logs as they come (always kept in build.log).")
@click.pass_context
def build(
    ctx,
    model,
    recipe,
    out,
    dataset,
    samples,
    seq_len,
    seed,
    revision,
    eval_text,
    eval_tokens,
    force,
    no_gates,
    dry_run,
    work_dir,
    fresh,
    stream,
    upgrade_budget,
    bpw,
    sensitivity,
    reference,
    device,
    compute_dtype,
    cpu_isa,
    card,
    as_json,
    verbose,
):
    """Quantize MODEL with RECIPE into a compressed-tensors artifact (+ qconv.json)."""
    from qconv.build.dryrun import dry_run as run_dry
    from qconv.build.options import BuildOptions
    from qconv.compute import limit_cpu_isa
    from qconv.errors import QconvError

    limit_cpu_isa(cpu_isa)  # before anything computes

    opts = BuildOptions(
        model=model,
        recipe=recipe,
        out=out,
        dataset=dataset,
        samples=samples,
        seq_len=seq_len,
        seed=seed,
        revision=revision,
        force=force,
        gates=not no_gates,
        eval_text=eval_text,
        eval_tokens=eval_tokens,
        work_dir=work_dir,
        fresh=fresh,
        stream=stream,
        upgrade_budget=upgrade_budget,
        bpw=bpw,
        sensitivity=sensitivity,
        reference=str(reference) if reference else None,
        device=device,
        compute_dtype=compute_dtype,
        card=card,
    )
    if dry_run:
        dr = run_dry(opts)
        print_plan(dr)
        if dr.selection is not None:
            from qconv.calibrate.select import format_table

            click.echo(format_table(dr.selection))
        print_device_budget(dr.device_budget, requested=device)
        return
    if out is None:
        raise QconvError("missing --out", where="qconv build", fix="pass --out DIR (or --dry-run to only plan)")
    verbose = verbose or bool((ctx.find_root().obj or {}).get("verbose"))
    _build_with_view(opts, as_json=as_json, verbose=verbose)


def _calibration_line(opts, recipe) -> str:
    """Which calibration size this build uses and where it comes from (a demo passes a small one)."""
    from qconv.build.options import calibration_choice

    cal = recipe.calibration
    dataset, samples, seq_len = calibration_choice(opts, recipe)
    given = [f for f, v in (("--samples", opts.samples), ("--seq-len", opts.seq_len)) if v]
    origin = (
        f"{'/'.join(given)}; recipe default {cal.samples} x {cal.seq_len}"
        if given
        else "recipe default; --samples/--seq-len change it"
    )
    data = dataset or f"{cal.default_dataset}, else self-generated text"
    return f"calibration: {samples} samples x {seq_len} tokens ({origin}) from {data}"


def _build_with_view(opts, *, as_json: bool, verbose: bool) -> None:
    """The build under a progress view (library logs into build.log), then the summary or its JSON."""
    import contextlib
    import sys
    import time

    from qconv import progress
    from qconv.build.options import recipe_for
    from qconv.build.pipeline import build as run_build
    from qconv.build.summary import artifact_summary, print_summary
    from qconv.errors import GateFailure
    from qconv.offline import offline_if_unreachable

    failure, t0 = None, time.time()
    recipe = recipe_for(opts)  # parsed once, for this line and the build
    calib = _calibration_line(opts, recipe)
    with contextlib.ExitStack() as stack:
        offline = stack.enter_context(offline_if_unreachable())  # before any library reads the flag
        view = stack.enter_context(progress.JobView(verbose=verbose))
        if as_json:
            stack.enter_context(progress.json_stdout())
        view.print(f"qconv build: {opts.model} -> {opts.out} (recipe {opts.recipe})")
        view.print(calib)
        if offline:
            view.print(offline)
        try:
            run_build(opts, recipe)
        except GateFailure as e:  # the artifact is written and marked failed: summarize it, then exit 1
            failure = e
    summary = {**artifact_summary(opts.out, view.log_path), "elapsed_s": round(time.time() - t0, 1)}
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        print_summary(summary)
    if failure:
        raise failure


COMMANDS = [build]
