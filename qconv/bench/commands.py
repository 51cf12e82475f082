"""CLI verb `qconv bench`: speed by workload for an artifact on a backend (or a running server), in one command.
Thin layer: options -> runner.Plan -> runner.run -> schema / render."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from qconv.compute import CHOICES
from qconv.errors import QconvError


def _ints(value: str, where: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise QconvError(f"{value!r} is not a list of positive integers", where=where, fix="e.g. 1,4,16")
    return out


def _artifact(target: str):
    from qconv.artifact import Artifact
    from qconv.hub.cache import resolve_artifact

    path = resolve_artifact(target)
    return path, Artifact.find(path)


def _backend(backend: str, art, profile: str | None) -> str:
    """What `qconv serve --backend auto` picks here, decided once so that both sides of a comparison use it."""
    if backend != "auto":
        return backend
    from qconv.serve import runtimes
    from qconv.serve.commands import cuda_gpu

    requires, pname = (art.requires, profile or art.default_profile) if art else ([], profile or "")
    choice = runtimes.choose_backend(requires, pname, runtimes.find_runtime(), cuda_gpu())
    click.echo(f"backend: {choice.backend} ({choice.reason})", err=True)
    return choice.backend


def _default_profile(art) -> str | None:
    """The profile `qconv serve ART` runs when none is named: what bench.json records for that side."""
    return art.default_profile if art is not None and art.profiles else None


SERVE_OPTIONS = {"spec-tokens": "--spec-tokens", "compute-dtype": "--compute-dtype"}  # --compare KEY=VALUE


def _sides(target, url, compare, backend, profile, over: dict[str, str], common: list[str], vllm_args: list[str]):
    """The one or two targets: a server to start (`qconv serve` arguments) or a URL each. `over`: the serve
    options (SERVE_OPTIONS' keys) given on the command line, which a `--compare KEY=VALUE` side changes."""
    from qconv.bench.runner import Side

    def started(path: Path, prof: str | None, opts: dict[str, str], label: str) -> Side:
        args = [str(path), "--backend", backend, *(["--profile", prof] if prof else []), *common]
        args += [a for k, v in opts.items() for a in (SERVE_OPTIONS[k], v)]
        return Side(label, args + (["--", *vllm_args] if vllm_args else []), None, str(path), backend, prof)

    if url:
        a = Side(url.split("//", 1)[-1].rstrip("/"), url=url)
        if compare is None:
            return [a]
        if not compare.startswith(("http://", "https://")):
            raise QconvError(
                "with --url, --compare takes a second server's URL", where="--compare", fix="http://HOST:PORT"
            )
        b = Side(compare.split("//", 1)[-1].rstrip("/"), url=compare)
        return [a, b] if a.label != b.label else [a, Side(b.label + " (2)", url=compare)]
    if target is None:
        raise QconvError(
            "no artifact and no --url", where="qconv bench", fix="qconv bench ART, or --url http://HOST:PORT"
        )
    path, art = _artifact(target)
    backend = _backend(backend, art, profile)
    prof = profile or _default_profile(art)
    if compare is None:
        return [started(path, prof, over, path.name)]
    key, eq, value = compare.partition("=")
    if eq and key in SERVE_OPTIONS:
        ok = value.isdigit() if key == "spec-tokens" else value in CHOICES
        if not ok or value == over.get(key, "auto" if key == "compute-dtype" else None):
            raise QconvError(
                f"{compare!r}: need a {key} other than the first side's", where="--compare",
                fix="e.g. spec-tokens=0 (speculation off) or compute-dtype=bfloat16",
            )  # fmt: skip
        first = f"{key}={over[key]}" if key in over else ("spec default" if key == "spec-tokens" else f"{key}=auto")
        return [started(path, prof, over, first), started(path, prof, {**over, key: value}, compare)]
    if art is not None and compare in art.profiles:
        if compare == prof:
            raise QconvError(
                f"--compare {compare} is the profile already measured", where="--compare", fix="name another profile"
            )
        return [started(path, prof, over, prof or "default"), started(path, compare, over, compare)]
    if not Path(compare).expanduser().is_dir():
        profiles = ", ".join(art.profiles) if art is not None and art.profiles else "none"
        raise QconvError(
            f"{compare!r} is neither an artifact folder nor a profile of {path.name} (profiles: {profiles})",
            where="--compare",
            fix="an artifact folder, a profile name, spec-tokens=N or compute-dtype=D",
        )
    path2, art2 = _artifact(compare)
    prof2 = profile if (profile and art2 and profile in art2.profiles) else _default_profile(art2)
    lb = path2.name if path2.name != path.name else path2.name + " (2)"
    return [started(path, prof, over, path.name), started(path2, prof2, over, lb)]


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("target", required=False, metavar="[ARTIFACT_OR_NAME]")
@click.option(
    "--backend",
    type=click.Choice(["auto", "native", "vllm"]),
    default="auto",
    show_default=True,
    help="The server to start, as `qconv serve --backend` picks it.",
)
@click.option("--profile", default=None, help="Serving profile (default: the artifact's).")
@click.option(
    "--url",
    default=None,
    help="Measure a running OpenAI-compatible server (ours, vLLM's, llama-server) instead of starting one.",
)
@click.option(
    "--workloads",
    default="copy,code,chat,math",
    show_default=True,
    help="Comma-separated: copy, code, chat, math, long.",
)
@click.option("--concurrency", default="1,4", show_default=True, help="Requests in flight, comma-separated levels.")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=2), help="Tokens per answer.")
@click.option(
    "--prompts",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompts per workload (each level runs them all).",
)
@click.option(
    "--data",
    multiple=True,
    metavar="DIR|WORKLOAD=FILE",
    help="Your own prompts: a folder of <workload>.jsonl/.txt, or one file for a workload; repeatable.",
)
@click.option(
    "--compare",
    default=None,
    metavar="ART2|PROFILE|spec-tokens=N|compute-dtype=D|URL2",
    help="A second target, measured turn about with the first.",
)
@click.option(
    "--port", default=0, type=click.IntRange(0, 65535), help="Port of the started server (default: a free one)."
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default=None,
    help="Native: where the engine runs (default: qconv serve's, auto).",
)
@click.option("--spec-tokens", default=None, type=int, help="Draft tokens per step on the started server(s) (0: off).")
@click.option(
    "--compute-dtype",
    type=click.Choice(CHOICES),
    default=None,
    help="What the started server(s) compute in (default: qconv serve's, auto).",
)
@click.option(
    "--max-batch",
    default=None,
    type=int,
    help="Sequences decoded together (default: the highest --concurrency level, on either backend).",
)
@click.option("--api-key", default=None, envvar="QCONV_API_KEY", help="Key the server wants (prefer QCONV_API_KEY).")
@click.option(
    "--out",
    default="bench-out",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for bench.json, bench.md, the charts and server logs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print bench.json on stdout (progress stays on stderr).")
@click.option("--no-charts", is_flag=True, help="Skip the PNG charts (no matplotlib needed).")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
def bench(
    target,
    backend,
    profile,
    url,
    workloads,
    concurrency,
    max_tokens,
    prompts,
    data,
    compare,
    port,
    device,
    spec_tokens,
    compute_dtype,
    max_batch,
    api_key,
    out,
    as_json,
    no_charts,
    vllm_args,
) -> None:
    """Speed of ARTIFACT_OR_NAME by workload and concurrency: output tok/s (in all and per request), TTFT and
    inter-token latency p50/p99, and tokens per verify step from the server's own counters.

    Starts `qconv serve` on a free loopback port and stops it after (or measures --url). Arguments after `--` go
    to vLLM unchanged. Writes OUT/bench.json, OUT/bench.md and OUT/bench-WORKLOAD.png."""
    from rich.console import Console

    from qconv.bench import render, runner
    from qconv.bench import workloads as wl

    if vllm_args and backend == "native":
        raise QconvError(
            f"extra arguments {' '.join(vllm_args)!r} are for vLLM", where="--backend native", fix="drop them"
        )
    names = wl.parse_workloads(workloads)
    levels = _ints(concurrency, "--concurrency")
    files = wl.data_files(names, data)
    for w in names:  # a bad data file fails here, before any server starts
        wl.texts(w, files[w], prompts, 4096)
    if not no_charts:
        render.require_matplotlib()
    if port:
        from qconv.bench.launch import check_port

        check_port(port)
    common = ["--max-batch", str(max_batch)] if max_batch else []
    common += ["--device", device] if device else []
    over = {"spec-tokens": str(spec_tokens)} if spec_tokens is not None else {}
    over |= {"compute-dtype": compute_dtype} if compute_dtype else {}
    sides = _sides(target, url, compare, backend, profile, over, common, list(vllm_args))
    for s in sides:  # the server batches as many sequences as the highest level sends (a profile may say 1)
        if s.url is None and not max_batch:
            s.serve_args[1:1] = ["--max-batch", str(max(levels))]
    console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
    plan = runner.Plan(
        sides,
        names,
        levels,
        prompts,
        max_tokens,
        files,
        Path(out),
        port,
        api_key,
        shlex.join(["qconv", *sys.argv[sys.argv.index("bench") :]]) if "bench" in sys.argv else "qconv bench",
    )
    report = runner.run(plan, runner.Console(console.print))
    plan.out.mkdir(parents=True, exist_ok=True)
    pngs = [] if no_charts else render.charts(report, plan.out)
    path = report.save(plan.out)
    (plan.out / "bench.md").write_text(render.markdown(report, pngs))
    console.print(render.terminal_table(report))
    console.print(f"wrote {path}, {plan.out / 'bench.md'}" + (f" and {len(pngs)} charts" if pngs else ""))
    if as_json:
        click.echo(path.read_text(), nl=False)
    if any(c.failed for c in report.cells):
        raise QconvError(
            f"{sum(c.failed for c in report.cells)} requests failed (the table counts them)",
            where=str(path),
            fix="see the errors in bench.json and the server log in " + str(plan.out),
        )


COMMANDS = [bench]
