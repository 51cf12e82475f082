"""Hub test helpers: a small fake artifact and a real HTTP server on 127.0.0.1 that can misbehave on purpose.

The server supports Range requests, logs every request (path + Range header), and per path can: cut the body
midway (then close), serve tampered bytes (one byte flipped), stall midway until released, or delay responses.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from qconv.hub import cache
from qconv.hub.index import Location, add_to_index_file, entry_for_artifact
from qconv.manifest import Manifest, ModuleDecision, RecipeInfo, SourceInfo, hash_artifact_files
from qconv.recipes.recipe import load_recipe
from tests.eval_helpers import quality_summary

BIG = "model-00001-of-00002.safetensors"
SMALL = "model-00002-of-00002.safetensors"


def make_artifact(folder: Path) -> Path:
    """A tiny but well-formed qconv artifact: 2 safetensors shards, config, tokenizer, and a real qconv.json."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    save_file(
        {
            "model.layers.0.mlp.down_proj.weight_packed": rng.integers(-(2**31), 2**31 - 1, (128, 512), np.int32),
            "model.layers.0.mlp.down_proj.weight_scale": rng.standard_normal((128, 32)).astype(np.float16),
            "model.layers.0.mlp.down_proj.weight_shape": np.array([128, 4096], np.int64),
        },
        str(folder / BIG),
    )
    save_file({"lm_head.weight": rng.standard_normal((64, 256)).astype(np.float16)}, str(folder / SMALL))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
                "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            }
        )
    )
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    Manifest(
        source=SourceInfo(kind="hub", id="Qwen/Qwen3-Tiny", revision="0123abc", architecture="qwen3"),
        recipe=RecipeInfo(name="3090", sha256="ab" * 32, resolved=load_recipe("3090").to_dict()),
        modules=[ModuleDecision("model.layers.0.mlp.down_proj", "mlp.down", "w4a16", 4, 128, [128, 4096])],
        files=hash_artifact_files(folder),
        quality=quality_summary(),
        status="ok",
        profiles={"fast": {"kv_cache": "bf16", "context_length": 4096}},
    ).write(folder)
    return folder


def flip_byte(data: bytes, at: int | None = None) -> bytes:
    at = len(data) // 2 if at is None else at
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


@dataclass
class Behaviour:
    cut: dict[str, int] = field(default_factory=dict)  # path -> how many responses to cut at half the body
    tamper: dict[str, int] = field(default_factory=dict)  # path -> how many responses to tamper (-1: always)
    stall: dict[str, threading.Event] = field(default_factory=dict)  # path -> send half, wait for the event, close
    pause: dict[str, threading.Event] = field(default_factory=dict)  # path -> send half, wait for the event, finish
    delay: dict[str, float] = field(default_factory=dict)  # path -> seconds to sleep before answering
    whole206: set[str] = field(default_factory=set)  # path -> answer a Range with 206 and the whole file
    no_length: set[str] = field(default_factory=set)  # path -> no Content-Length (body ends when the server closes)


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class FileServer:
    """ThreadingHTTPServer over `root` in a background thread; `log` holds (path, Range header or None) and
    `requests` (method, path, Range, Authorization) of every request."""

    def __init__(self, root: Path | None):
        self.root, self.log, self.requests, self.b = root, [], [], Behaviour()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def do_GET(self):
                server.handle(self, head=False)

            def do_HEAD(self):
                server.handle(self, head=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def _take(self, counts: dict[str, int], path: str) -> bool:
        with self.lock:
            n = counts.get(path, 0)
            if n == 0:
                return False
            if n > 0:
                counts[path] = n - 1
            return True

    def lookup(self, path: str, query: dict) -> Reply:
        f = (self.root / path.lstrip("/")).resolve()
        if not f.is_file() or self.root.resolve() not in f.parents:
            return Reply(404)
        return Reply(200, f.read_bytes())

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        import time

        url = urllib.parse.urlparse(h.path)
        path = urllib.parse.unquote(url.path)
        rng = h.headers.get("Range")
        with self.lock:
            self.log.append((path, rng))
            self.requests.append(("HEAD" if head else "GET", path, rng, h.headers.get("Authorization")))
        if path in self.b.delay:
            time.sleep(self.b.delay[path])
        reply = self.lookup(path, urllib.parse.parse_qs(url.query))
        if reply.status != 200:
            h.send_response(reply.status)
            for k, v in reply.headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(reply.body)))
            h.end_headers()
            if not head:
                h.wfile.write(reply.body)
            return
        data = reply.body
        if not head and self._take(self.b.tamper, path):
            data = flip_byte(data)
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        if start >= len(data) and rng:
            h.send_error(416)
            return
        if path in self.b.whole206:
            start = 0
        body = data[start:]
        h.send_response(206 if rng else 200)
        for k, v in reply.headers.items():
            h.send_header(k, v)
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if path not in self.b.no_length:
            h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        if head:
            return
        stall = self.b.stall.pop(path, None)
        pause = self.b.pause.pop(path, None)
        if self._take(self.b.cut, path) or stall or pause:
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            if stall or pause:
                (stall or pause).wait(20)
            if not pause:
                h.close_connection = True
                return
            body = body[len(body) // 2 :]
        h.wfile.write(body)

    def gets(self, path: str) -> list[str | None]:
        """Range headers of every request for `path` (None for a plain GET)."""
        with self.lock:
            return [r for p, r in self.log if p == path]

    def close(self) -> None:
        for ev in [*self.b.stall.values(), *self.b.pause.values()]:
            ev.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub(FileServer):
    """The Hub endpoints huggingface_hub calls, over in-memory repos: model info with files metadata
    (`/api/models/R/revision/REV?blobs=true`), the tree listing, and `/R/resolve/REV/FILE` (HEAD and GET, with
    X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size, Range). `*.safetensors` are LFS objects, the rest git blobs.
    `after_info(repo, rev)` runs after each model-info answer (a test moves a branch there)."""

    def __init__(self):
        super().__init__(None)
        self.repos: dict[str, dict] = {}
        self.after_info = None
        self.served: dict[str, bytes] = {}  # file name -> bytes served instead (a mirror that alters content)

    def publish(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Commit `files` to `branch` of `repo`; returns the commit sha."""
        sha = hashlib.sha1(
            repr(sorted((n, hashlib.sha256(d).hexdigest()) for n, d in files.items())).encode() + repo.encode()
        ).hexdigest()
        r = self.repos.setdefault(repo, {"refs": {}, "commits": {}})
        r["commits"][sha] = dict(files)
        r["refs"][branch] = sha
        return sha

    @staticmethod
    def _lfs(name: str) -> bool:
        return name.endswith(".safetensors")

    def _meta(self, name: str, data: bytes, tree: bool) -> dict:
        lfs = {"size": len(data), "pointerSize": 134}
        lfs["oid" if tree else "sha256"] = hashlib.sha256(data).hexdigest()
        d = {"size": len(data), ("oid" if tree else "blobId"): git_blob_id(data)}
        if tree:
            d.update(type="file", path=name)
        else:
            d["rfilename"] = name
        if self._lfs(name):
            d["lfs"] = lfs
        return d

    def _commit(self, repo: str, rev: str) -> str | None:
        r = self.repos[repo]
        return rev if rev in r["commits"] else r["refs"].get(rev)

    def lookup(self, path: str, query: dict) -> Reply:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) == 4:  # no revision: the default branch
            repo, kind, rev = "/".join(parts[2:4]), "revision", "main"
        elif parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo, kind, rev = "/".join(parts[:2]), "resolve", parts[3]
        else:
            return Reply(404)
        if repo not in self.repos:
            return Reply(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        sha = self._commit(repo, rev)
        if sha is None:
            return Reply(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
        files = self.repos[repo]["commits"][sha]
        if kind == "revision":
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            info = {
                "id": repo,
                "modelId": repo,
                "sha": sha,
                "private": False,
                "siblings": [
                    self._meta(n, d, tree=False) if blobs else {"rfilename": n} for n, d in sorted(files.items())
                ],
            }
            if self.after_info:
                self.after_info(repo, rev)
            return Reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if kind == "tree":
            return Reply(
                200,
                json.dumps([self._meta(n, d, tree=True) for n, d in sorted(files.items())]).encode(),
                {"Content-Type": "application/json"},
            )
        name = "/".join(parts[4:])
        if name not in files:
            return Reply(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
        data = self.served.get(name, files[name])
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_id(data)}"'}
        if self._lfs(name):
            headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))})
        return Reply(200, data, headers)

    def resolve_path(self, repo: str, sha: str, name: str) -> str:
        return f"/{repo}/resolve/{sha}/{name}"


NAME = "tiny-w4a16"
BIG_PATH = f"/artifacts/{NAME}/{BIG}"


class Hub:
    def __init__(self, tmp: Path):
        self.root = tmp / "served"
        self.art = make_artifact(self.root / "artifacts" / NAME)
        self.server = FileServer(self.root)
        self.index_url = f"{self.server.url}/index.json"
        self.art_url = f"{self.server.url}/artifacts/{NAME}"
        self.index_file = self.root / "index.json"
        add_to_index_file(self.index_file, entry_for_artifact(self.art, Location("url", self.art_url), card="tiny"))
        self.home = tmp / "home"

    def edit_index(self, fn) -> None:
        d = json.loads(self.index_file.read_text())
        fn(d["artifacts"][0])
        self.index_file.write_text(json.dumps(d))

    @property
    def loc(self) -> Location:
        return Location("url", self.art_url)

    def cached(self) -> Path | None:
        """The current cached revision of the served artifact (QCONV_HOME is this hub's home)."""
        return cache.current(self.loc)

    def stray(self) -> list[str]:
        """Anything under the cache besides the finished slot, its locks and the name records."""
        root, slot, rev = self.home / "artifacts", cache.slot_key(self.loc), self.cached().name
        allowed = {
            slot,
            f"{slot}/source.json",
            f"{slot}/current",
            f"{slot}/revs",
            f"{slot}/revs/{rev}",
            f"{slot}/revs/{rev}.lock",
            ".locks",
            f".locks/{slot}.lock",
            ".names",
            ".incoming",
        }
        found = [p.relative_to(root).as_posix() for p in root.rglob("*")]
        return [f for f in found if f not in allowed and not f.startswith((f"{slot}/revs/{rev}/", ".names/"))]


def served_hub(tmp_path, monkeypatch):
    """A Hub over tmp_path with QCONV_HOME pointed at its home (tests/conftest.py `hub`)."""
    h = Hub(tmp_path)
    monkeypatch.setenv("QCONV_HOME", str(h.home))
    monkeypatch.delenv("QCONV_INDEX", raising=False)
    yield h
    h.server.close()


def assert_same_tree(a: Path, b: Path) -> None:
    fa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert fa == fb
    for n in fa:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
