"""CLI verbs for prebuilt artifacts: pull, list, verify, push, index add. Thin layers over qconv.hub."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

INSECURE_OPT = click.option(
    "--insecure", is_flag=True, help="Allow plain http:// for URLs and the index (only on a network you trust)."
)
INDEX_OPT = click.option(
    "--index",
    "index",
    metavar="URL_OR_PATH",
    default=None,
    help="Artifact index to use instead of the shipped one (env QCONV_INDEX).",
)


@click.command()
@click.argument("target")
@click.option("--revision", default=None, help="Branch, tag or commit (Hugging Face locations).")
@click.option("--offline", is_flag=True, help="Use the cache only; fail if the artifact is not there.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@INDEX_OPT
@INSECURE_OPT
def pull(target: str, revision: str | None, offline: bool, quiet: bool, index: str | None, insecure: bool) -> None:
    """Download a prebuilt artifact (NAME | ORG/NAME | URL | FOLDER) into the cache, verified; prints its path.

    Hub repos go through huggingface_hub (HF_TOKEN, HF_ENDPOINT for a mirror), pinned to the commit the revision
    resolves to."""
    from qconv.hub.pull import pull as do_pull

    click.echo(
        str(do_pull(target, revision=revision, offline=offline, index=index, progress=not quiet, insecure=insecure))
    )


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@click.command("list")
@click.option("--remote", is_flag=True, help="List the artifacts in the index instead of the local cache.")
@INDEX_OPT
@INSECURE_OPT
def list_cmd(remote: bool, index: str | None, insecure: bool) -> None:
    """List pulled artifacts (or, with --remote, those the index offers)."""
    from qconv.hub import cache

    rows = [["NAME", "RECIPE", "SIZE", "FROM" if not remote else "LOCATION", "CACHED" if remote else "PATH"]]
    if remote:
        from qconv.hub.index import load_index

        for e in load_index(index, insecure=insecure).artifacts:
            rows.append(
                [
                    e.name,
                    e.recipe,
                    f"{e.total_size() / 1e9:.2f} GB",
                    e.location.describe(),
                    "yes" if cache.current(e.location) else "no",
                ]
            )
    else:
        for a in cache.list_cached():
            rows.append(
                [a.name, a.meta.get("recipe", "?"), f"{a.size / 1e9:.2f} GB", a.meta.get("location", "?"), str(a.path)]
            )
    if len(rows) == 1:
        click.echo("no artifacts in the index" if remote else "no pulled artifacts (see `qconv list --remote`)")
        return
    _table(rows)


@click.command()
@click.argument("target")
def verify(target: str) -> None:
    """Recompute every file hash of an artifact (folder or pulled NAME) against its qconv.json; exit 1 on mismatch."""
    from qconv.hub.cache import resolve_artifact
    from qconv.hub.verify import summary_lines, verify_artifact

    report = verify_artifact(resolve_artifact(target))
    for line in summary_lines(report):
        click.echo(line)
    report.raise_for_problems()
    click.echo(f"verified: all {len(report.manifest.files)} files match qconv.json")


@click.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--repo", "repo_id", required=True, help="Hugging Face repo id, ORG/NAME (created if missing).")
@click.option("--revision", default=None, help="Branch to push to.")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
def push(artifact_dir: str, repo_id: str, revision: str | None, private: bool, create_pr: bool) -> None:
    """Upload a verified artifact to the Hugging Face Hub with a generated model card."""
    from qconv.hub.push import push as do_push

    click.echo(do_push(artifact_dir, repo_id, revision=revision, private=private, create_pr=create_pr))


@click.group()
def index() -> None:
    """Maintain artifact index files."""


@index.command("add")
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--index",
    "index_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Index file to add to (created if missing); without it the entry is printed.",
)
@click.option(
    "--location",
    default=None,
    metavar="LOC",
    help="Where the artifact is served: hf:ORG/NAME[@REV], http(s)://.../NAME, file://... or a folder "
    "(default: this folder).",
)
@click.option("--name", default=None, help="Artifact name (default: the folder name).")
@click.option("--card", default="", help="One-paragraph description.")
def index_add(artifact_dir: str, index_file: str | None, location: str | None, name: str | None, card: str) -> None:
    """Verify ARTIFACT_DIR and write its index entry (name, recipe, source, files with sha256, quality, location)."""
    from qconv.hub.index import add_to_index_file, entry_for_artifact, parse_location

    entry = entry_for_artifact(artifact_dir, parse_location(location or artifact_dir), name=name, card=card)
    if index_file:
        add_to_index_file(index_file, entry)
        click.echo(f"added {entry.name} ({len(entry.files)} files) to {index_file}")
    else:
        click.echo(json.dumps(asdict(entry), indent=2))


COMMANDS = [pull, list_cmd, verify, push, index]
