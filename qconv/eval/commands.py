"""`qconv eval` and `qconv check`: thin click layers over qconv.eval.run."""

from __future__ import annotations

import contextlib

import click

from qconv.compute import CHOICES


def compute_dtype_option(what: str, note: str):
    """--compute-dtype for `what` (the same choices on build, eval and check), `note` where it is recorded."""
    return click.option(
        "--compute-dtype",
        type=click.Choice(CHOICES),
        default="auto",
        show_default=True,
        help=f"What {what} compute in. auto: bf16 on a GPU or a CPU with native bf16 (AVX-512 bf16 / AMX), else "
        f"float32. {note}",
    )


def _text_options(f):
    for opt in reversed(
        [
            click.option(
                "--reference",
                help="Full-precision source model, or a reference cache folder it made "
                "(QCONV_HOME/reference/KEY, named in report.json; default: the source in qconv.json).",
            ),
            click.option("--text", help="Held-out text: a file, or an HF dataset id org/name[:config][@split]."),
            click.option("--window", type=int, help="Tokens per window (default 2048)."),
            click.option("--max-tokens", type=int, help="Use at most this many tokens of the text (default 8192)."),
            click.option("--kv", help="KV-cache scheme to simulate (fp8_e4m3, kvarn_…, or 'auto' = the recipe's)."),
            click.option("--recipe", help="Judge by this recipe's gates instead of the one recorded in qconv.json."),
            click.option(
                "--profile",
                help="Also simulate this profile's int8 activations (its w4a8 roles), gated like the KV cache.",
            ),
            click.option("--out", type=click.Path(file_okay=False), help="Write report.json/report.md/kld.png here."),
            click.option(
                "--streamed/--whole-model",
                default=None,
                help="Layer-streamed forward (one decoder layer in memory) or whole model "
                "(default: streamed when the model does not fit in free memory).",
            ),
            click.option(
                "--device",
                type=click.Choice(["cpu", "cuda"]),
                help="Run the forward passes here (default: cuda when available).",
            ),
            compute_dtype_option("the forwards", "Recorded in report.json."),
            click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object on stdout."),
        ]
    ):
        f = opt(f)
    return f


@contextlib.contextmanager
def _output(as_json: bool):
    """Yields `emit(report)` for an EvalReport: the markdown report for a person, or with --json its JSON object on
    stdout (whatever else is printed meanwhile goes to stderr)."""
    if not as_json:
        from qconv.eval.report import render_md

        yield lambda report: click.echo(render_md(report))
        return
    from qconv.progress import json_stdout

    with json_stdout() as emit:
        yield lambda report: emit(report.data)


@click.command("eval")
@click.argument("artifact", type=click.Path())
@_text_options
@click.option("--ref-topk", type=int, help="Reference storage: 0 = full log-probs, K = top-K (default: auto).")
@click.option("--tasks", help="lm-eval tasks, comma-separated (shipped: gsm8k_local, wikitext_local).")
@click.option("--limit", type=int, help="At most this many documents per task.")
@click.option("--task-data", multiple=True, metavar="TASK=PATH", help="Local data file for a shipped task.")
@click.option("--max-gen-toks", type=int, help="Cap generation length of shipped generative tasks (CPU smoke runs).")
@click.option(
    "--kv-form",
    type=click.Choice(["decode", "prefill"]),
    default="decode",
    show_default=True,
    help="KV simulation: what the runtime's decode steps read (the sink and the tile being filled "
    "exact), or every full tile quantized for every query (pessimistic).",
)
def eval_cmd(
    artifact,
    reference,
    text,
    window,
    max_tokens,
    kv,
    recipe,
    profile,
    out,
    streamed,
    device,
    compute_dtype,
    as_json,
    ref_topk,
    tasks,
    limit,
    task_data,
    max_gen_toks,
    kv_form,
):
    """Measure ARTIFACT's quality cost against its source: KLD, top-1, PPL (and KV cache, tasks)."""
    from qconv.errors import QconvError
    from qconv.eval.forward import Forward
    from qconv.eval.record import EvalSettings
    from qconv.eval.run import evaluate

    if not text:
        raise QconvError("qconv eval needs held-out text", where="--text", fix="pass --text FILE_OR_HF_DATASET_ID")
    data = {}
    for item in task_data:
        name, sep, path = item.partition("=")
        if not sep:
            raise QconvError(f"bad --task-data {item!r}", where="--task-data", fix="use TASK=PATH")
        data[name] = path
    settings = EvalSettings(
        text=text, window=window or 2048, max_tokens=max_tokens or 8192, kv=kv, kv_form=kv_form, ref_topk=ref_topk
    )
    with _output(as_json) as emit:
        emit(
            evaluate(
                artifact,
                settings,
                reference=reference,
                recipe=recipe,
                tasks=[t.strip() for t in tasks.split(",") if t.strip()] if tasks else None,
                limit=limit,
                task_data=data,
                max_gen_toks=max_gen_toks,
                out=out,
                fwd=Forward(streamed=streamed, device=device, compute_dtype=compute_dtype),
                profile=profile,
            )
        )


@click.command("check")
@click.argument("artifact", type=click.Path())
@_text_options
@click.option("--against", help="Regress against this artifact or report.json (default: the recorded report).")
@click.option("--junit", type=click.Path(dir_okay=False), help="Write JUnit XML for CI.")
def check(
    artifact,
    reference,
    text,
    window,
    max_tokens,
    kv,
    recipe,
    profile,
    out,
    streamed,
    device,
    compute_dtype,
    as_json,
    against,
    junit,
):
    """Re-measure ARTIFACT; exit 1 on a failed quality gate or a regression beyond tolerance."""
    from qconv.errors import GateFailure
    from qconv.eval.forward import Forward
    from qconv.eval.run import check as run_check

    with _output(as_json) as emit:
        try:
            report = run_check(
                artifact,
                against=against,
                junit=junit,
                reference=reference,
                recipe=recipe,
                text=text,
                window=window,
                max_tokens=max_tokens,
                kv=kv,
                out=out,
                fwd=Forward(streamed=streamed, device=device, compute_dtype=compute_dtype),
                profile=profile,
            )
        except GateFailure as e:  # scripts get the measurement with the failure (exit 1 all the same)
            if as_json and e.report is not None:
                emit(e.report)
            raise
        emit(report)
    if not as_json:
        click.echo(
            f"check passed: {len(report.verdicts or ())} checks ({report.tier.name if report.tier else None} tier)"
        )


COMMANDS = [eval_cmd, check]
