"""`qconv push`: publish a verified artifact to a Hugging Face repo with a model card generated from qconv.json.

The card is written into a staging folder of hard links beside the artifact, so the upload is one commit
(weights + qconv.json + README.md) and the artifact folder itself stays exactly what its manifest lists.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from qconv.convert.requires import NEEDS_ENGINE
from qconv.errors import QconvError
from qconv.hub.verify import quality_rows, verify_artifact
from qconv.manifest import MANIFEST, Manifest, Requirement


def model_card(manifest: Manifest, repo_id: str) -> str:
    """README.md for the hub: what it was made from, how, what it costs in quality, and how to serve it."""
    src = manifest.source
    name = repo_id.split("/")[-1]
    base = src.id if src.kind == "hub" else None
    front = ["---", "library_name: transformers", "tags:", "  - qconv", "  - compressed-tensors", "  - quantized"]
    if base:
        front.append(f"base_model: {base}")
    front.append("---")
    out = front + [
        "",
        f"# {name}",
        "",
        f"Quantized with qconv from `{src.id}`"
        + (f" (revision `{src.revision}`)" if src.revision else "")
        + f" using recipe `{manifest.recipe.name}`.",
        "",
        "## Provenance",
        "",
        "| | |",
        "|---|---|",
        f"| source | `{src.id}` |",
        f"| source revision | `{src.revision or '-'}` |",
        f"| source architecture | `{src.architecture or '-'}` |",
        f"| source files sha256 | `{src.sha256 or '-'}` |",
        f"| recipe | `{manifest.recipe.name}` (sha256 `{manifest.recipe.sha256[:16]}`) |",
        f"| status | `{manifest.status}` |",
        f"| size | {manifest.total_size() / 1e9:.2f} GB in {len(manifest.files)} files |",
        "",
        "## Quality",
        "",
    ]
    rows = quality_rows(manifest.quality.data if manifest.quality else None)
    if rows:
        out += ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    else:
        out.append("No quality report was recorded for this artifact.")
    if manifest.requires:
        out += ["", "## Requirements", ""] + [
            f"- {r.feature}{_scope(r)}: needs {r.needs} — {r.reason}" for r in manifest.requires
        ]
    out += [
        "",
        "## Serving",
        "",
        "```bash",
        f"qconv pull {repo_id}",
        f"qconv serve {repo_id}",
        "```",
        "",
        *_vllm_lines(manifest, repo_id),
        f"`{MANIFEST}` lists the sha256 of every file; `qconv verify` rechecks them after download.",
        "",
    ]
    return "\n".join(out)


def _scope(r: Requirement) -> str:
    parts = ([f"profile {r.profile} only"] if r.profile else []) + ([f"{r.platform} vLLM only"] if r.platform else [])
    return f" ({', '.join(parts)})" if parts else ""


def _vllm_lines(manifest: Manifest, repo_id: str) -> list[str]:
    """How (and whether) vLLM runs it, from `requires`: stock vLLM only when nothing there applies everywhere."""
    everywhere = [r for r in manifest.requires if r.profile is None and r.platform is None]
    if any(r.needs.lower() in NEEDS_ENGINE for r in everywhere):
        return ["vLLM cannot run this artifact (see Requirements): serve it with `qconv serve`.", ""]
    if everywhere:
        return [
            "Or with vLLM 0.32 and the qconv-vllm plugin (`qconv runtime install` makes that environment; "
            "stock vLLM cannot load it, see Requirements):",
            "",
            "```bash",
            f"vllm serve {repo_id}",
            "```",
            "",
        ]
    return ["Or with vLLM (compressed-tensors is read natively):", "", "```bash", f"vllm serve {repo_id}", "```", ""]


@contextlib.contextmanager
def _staged(artifact_dir: Path, names: list[str], card: str):
    """A folder beside the artifact with hard links (symlinks if the filesystem refuses) plus README.md."""
    stage = Path(tempfile.mkdtemp(dir=artifact_dir.parent, prefix=f".{artifact_dir.name}.", suffix=".push"))
    try:
        for n in names:
            (stage / n).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(artifact_dir / n, stage / n)
            except OSError:
                os.symlink((artifact_dir / n).resolve(), stage / n)
        (stage / "README.md").write_text(card)
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def push(
    artifact_dir: str | Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    create_pr: bool = False,
    token: str | None = None,
) -> str:
    """Verify, then create the repo (if needed) and upload folder + card in one commit. Returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    path = Path(artifact_dir).resolve()
    report = verify_artifact(path)
    report.raise_for_problems()
    card = model_card(report.manifest, repo_id)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        with _staged(path, [*report.manifest.files, MANIFEST], card) as stage:
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=stage,
                repo_type="model",
                revision=revision,
                create_pr=create_pr,
                commit_message=f"qconv push: {report.manifest.recipe.name} artifact",
            )
    except (HfHubHTTPError, OSError) as e:
        raise QconvError(
            f"push to {repo_id} failed: {e}",
            where=repo_id,
            fix="check the repo id, your HF token (`hf auth login`) and network",
        ) from e
    return str(getattr(info, "commit_url", info))
