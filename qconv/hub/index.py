"""The registry index: a JSON list of prebuilt artifacts, where each lives, and the hashes that make it trustworthy.

The index is the trust root of `qconv pull NAME`: every file (qconv.json included) is checked against the sha256
listed here before the artifact becomes visible. The package ships a default index; `--index URL_OR_PATH` or
`QCONV_INDEX` replace it.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from qconv.errors import QconvError
from qconv.fsutil import file_table, write_json_atomic
from qconv.hub.download import check_scheme
from qconv.manifest import FileEntry
from qconv.recipes.schema import version_problem

INDEX_SCHEMA_VERSION = 1
INDEX_CAP = 32 << 20
LOCATION_KINDS = ("hf", "url", "path")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
HF_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Location:
    kind: str  # "hf" (uri = repo id) | "url" (uri = http(s) base URL of the folder) | "path" (uri = local folder)
    uri: str
    revision: str | None = None  # hf only: branch, tag or commit

    def describe(self) -> str:
        return f"hf:{self.uri}" + (f"@{self.revision}" if self.revision else "") if self.kind == "hf" else self.uri


@dataclass
class SourceRef:
    id: str
    revision: str | None = None


@dataclass
class IndexEntry:
    name: str
    recipe: str
    source: SourceRef
    location: Location
    files: dict[str, FileEntry]  # every file of the folder, qconv.json included
    card: str = ""  # one-paragraph description shown by `qconv list --remote`
    quality: dict[str, Any] = field(default_factory=dict)

    def total_size(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass
class Index:
    artifacts: list[IndexEntry] = field(default_factory=list)
    schema_version: int = INDEX_SCHEMA_VERSION

    def get(self, name: str) -> IndexEntry | None:
        return next((e for e in self.artifacts if e.name == name), None)

    def to_dict(self) -> dict:
        return asdict(self)


def check_name(name: str, where: str) -> str:
    if not NAME_RE.match(name):
        raise QconvError(
            f"invalid artifact name {name!r}",
            where=where,
            fix="use letters, digits, '.', '_' and '-' only (it becomes a cache folder name)",
        )
    return name


def parse_location(spec: str) -> Location:
    """`hf:ORG/NAME[@REV]`, `http(s)://...`, `file://...` or a local folder path."""
    if spec.startswith(("http://", "https://")):
        return Location("url", spec.rstrip("/"))
    if spec.startswith("file://"):
        return Location("path", str(Path(spec[len("file://") :]).resolve()))
    if spec.startswith("hf:"):
        repo, _, rev = spec[3:].lstrip("/").partition("@")
        if not HF_ID_RE.match(repo):
            raise QconvError(f"invalid Hugging Face repo id {repo!r}", where=spec, fix="write hf:ORG/NAME[@REVISION]")
        return Location("hf", repo, rev or None)
    return Location("path", str(Path(spec).expanduser().resolve()))


def location_uri(kind: str, uri: str, where: str) -> str:
    """An index location's uri, checked for its kind: a `url` is http(s) only (file://, ftp:// and the rest are
    refused: a file:// url would bypass the `path` kind's link checks, ftp has neither TLS nor ranges); a `path` is
    an absolute folder, written plainly or as file://, and pulled with the `path` kind's link refusals."""
    if kind == "url" and not uri.startswith(("https://", "http://")):
        raise QconvError(
            f"location kind 'url' takes an https:// URL, not {uri[:80]!r}",
            where=where,
            fix='write {"kind": "path", "uri": "/abs/folder"} for a local folder; serve anything else over https',
        )
    if kind == "path":
        path = uri[len("file://") :] if uri.startswith("file://") else uri
        if "://" in path or not Path(path).is_absolute():
            raise QconvError(
                f"location kind 'path' takes an absolute folder, not {uri[:80]!r}",
                where=where,
                fix="write the folder's absolute path (or file:///abs/folder)",
            )
        return str(Path(path))
    return uri


def _req(d: dict, key: str, typ: type | tuple, where: str):
    if not isinstance(d, dict):
        raise QconvError(f"expected an object, got {type(d).__name__}", where=where, fix="see qconv/hub/index.json")
    if key not in d:
        raise QconvError(f"missing key {key!r}", where=where, fix="see qconv/hub/index.json for the schema")
    if not isinstance(d[key], typ):
        raise QconvError(
            f"key {key!r} has type {type(d[key]).__name__}",
            where=where,
            fix=f"it must be {getattr(typ, '__name__', typ)}",
        )
    return d[key]


def _opt(d: dict, key: str, typ: type, default, where: str):
    return _req(d, key, typ, where) if d.get(key) is not None else default


def entry_from_dict(d: dict, where: str) -> IndexEntry:
    if not isinstance(d, dict):
        raise QconvError("index entry is not an object", where=where)
    name = check_name(_req(d, "name", str, where), where)
    where = f"{where}[{name}]"
    loc = _req(d, "location", dict, where)
    kind = _req(loc, "kind", str, f"{where}.location")
    if kind not in LOCATION_KINDS:
        raise QconvError(
            f"unknown location kind {kind!r}", where=f"{where}.location", fix=f"use one of {', '.join(LOCATION_KINDS)}"
        )
    uri = location_uri(kind, _req(loc, "uri", str, f"{where}.location"), f"{where}.location")
    files = {}
    for fname, f in _req(d, "files", dict, where).items():
        fw = f"{where}.files[{fname}]"
        sha, size = _req(f, "sha256", str, fw), _req(f, "size", int, fw)
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise QconvError(f"bad sha256 {sha!r}", where=fw, fix="write 64 lowercase hex digits")
        files[fname] = FileEntry(sha, size)
    src = _req(d, "source", dict, where)
    return IndexEntry(
        name=name,
        recipe=_req(d, "recipe", str, where),
        source=SourceRef(_req(src, "id", str, f"{where}.source"), src.get("revision")),
        location=Location(kind, uri, loc.get("revision")),
        files=files,
        card=_opt(d, "card", str, "", where),
        quality=_opt(d, "quality", dict, {}, where),
    )


def index_from_dict(d: Any, where: str) -> Index:
    if not isinstance(d, dict):
        raise QconvError("index is not a JSON object", where=where, fix="see qconv/hub/index.json for the schema")
    if d.get("schema_version") != INDEX_SCHEMA_VERSION:
        raise QconvError(
            version_problem("index", d.get("schema_version"), INDEX_SCHEMA_VERSION),
            where=where,
            fix=f'write "schema_version": {INDEX_SCHEMA_VERSION}, or upgrade qconv for a newer index',
        )
    entries = [entry_from_dict(e, f"{where}:artifacts[{i}]") for i, e in enumerate(_req(d, "artifacts", list, where))]
    names = [e.name for e in entries]
    if dups := sorted({n for n in names if names.count(n) > 1}):
        raise QconvError(f"duplicate artifact names {dups}", where=where, fix="each name may appear once")
    return Index(entries)


def default_index_spec() -> str:
    return os.environ.get("QCONV_INDEX") or str(resources.files("qconv.hub") / "index.json")


def load_index(spec: str | None = None, *, offline: bool = False, insecure: bool = False) -> Index:
    """Read the index from a path, file:// or https URL; None means QCONV_INDEX, else the shipped default.

    `offline` refuses a remote index instead of fetching it; plain http:// needs `insecure` (the index is the trust
    root: whoever can rewrite it in transit chooses the hashes)."""
    spec = spec or default_index_spec()
    remote = spec.startswith(("http://", "https://"))
    if remote and offline:
        raise QconvError("the artifact index is remote and the network is not to be used", where=spec)
    check_scheme(spec, insecure)
    try:
        if remote:
            with urllib.request.urlopen(spec, timeout=30) as r:
                text = r.read(INDEX_CAP + 1).decode()
        else:  # the remote cap applies here too: a local index is read no further than it
            with open(Path(spec[len("file://") :] if spec.startswith("file://") else spec).expanduser(), "rb") as f:
                text = f.read(INDEX_CAP + 1).decode()
        if len(text) > INDEX_CAP:
            raise QconvError(f"artifact index larger than {INDEX_CAP >> 20} MB", where=spec)
    except (OSError, urllib.error.URLError, UnicodeDecodeError) as e:
        raise QconvError(
            f"cannot read the artifact index: {e}",
            where=spec,
            fix="check --index / QCONV_INDEX, or use `qconv pull --offline NAME` for cached artifacts",
        ) from e
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # bad JSON, an over-long integer, nesting deeper than Python's stack
        raise QconvError(
            f"artifact index is not valid JSON: {str(e)[:200] or type(e).__name__}",
            where=spec,
            fix="check --index / QCONV_INDEX: it must name a qconv index (see qconv/hub/index.json)",
        ) from e
    return index_from_dict(data, spec)


def entry_for_artifact(
    artifact_dir: str | Path, location: Location, name: str | None = None, card: str = ""
) -> IndexEntry:
    """An index entry describing a verified local artifact, as it will be served from `location`."""
    from qconv.hub.verify import verify_artifact

    report = verify_artifact(artifact_dir)
    report.raise_for_problems()
    m = report.manifest
    name = check_name(name or Path(artifact_dir).resolve().name, str(artifact_dir))
    files = {k: FileEntry(**v) for k, v in file_table(artifact_dir).items() if k in m.files or k == "qconv.json"}
    return IndexEntry(
        name=name,
        recipe=m.recipe.name,
        source=SourceRef(m.source.id, m.source.revision),
        location=location,
        files=files,
        card=card,
        quality=m.quality.data if m.quality else {},
    )


def add_to_index_file(index_file: str | Path, entry: IndexEntry) -> Index:
    """Add or replace `entry` (by name) in a local index file, creating it if needed; written atomically."""
    path = Path(index_file)
    index = load_index(str(path)) if path.exists() else Index()
    index.artifacts = [e for e in index.artifacts if e.name != entry.name] + [entry]
    index.artifacts.sort(key=lambda e: e.name)
    write_json_atomic(path, index.to_dict())
    return index
