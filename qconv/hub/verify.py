"""`qconv verify`: does this folder still hold exactly the bytes its qconv.json promises, and what did it measure?"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qconv.hub.download import IntegrityError
from qconv.manifest import Manifest, read_manifest, verify_files


@dataclass
class VerifyReport:
    path: Path
    manifest: Manifest
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if self.problems:
            raise IntegrityError(
                f"{len(self.problems)} file(s) do not match qconv.json:\n  " + "\n  ".join(self.problems),
                where=str(self.path),
                fix="re-pull (`qconv pull NAME`) or rebuild the artifact",
            )


def verify_artifact(artifact_dir: str | Path) -> VerifyReport:
    """Schema check (read_manifest) plus a full rehash of every file against the manifest's table."""
    path = Path(artifact_dir)
    m = read_manifest(path)
    return VerifyReport(path, m, verify_files(path, m))


def quality_rows(quality: dict[str, Any] | None, prefix: str = "") -> list[tuple[str, str]]:
    """Flatten the manifest's quality summary (nested dicts) into (dotted key, value) rows for tables and cards."""
    rows: list[tuple[str, str]] = []
    for k, v in (quality or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            rows += quality_rows(v, key + ".")
        elif isinstance(v, float):
            rows.append((key, f"{v:.6g}"))
        else:
            rows.append((key, str(v)))
    return rows


def summary_lines(report: VerifyReport) -> list[str]:
    m = report.manifest
    lines = [
        f"artifact: {report.path}",
        f"source:   {m.source.id}" + (f"@{m.source.revision}" if m.source.revision else ""),
        f"recipe:   {m.recipe.name} (sha256 {m.recipe.sha256[:12]})",
        f"status:   {m.status}",
        f"files:    {len(m.files)}, {m.total_size() / 1e6:.1f} MB",
    ]
    rows = quality_rows(m.quality.data if m.quality else None)
    if rows:
        width = max(len(k) for k, _ in rows)
        lines += ["quality:"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    else:
        lines.append("quality:  (no quality report in the manifest)")
    return lines
