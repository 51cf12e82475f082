"""Hub pulls through the real huggingface_hub client against a stand-in of the Hub API on 127.0.0.1 (HF_ENDPOINT):
pinned to the resolved commit, every file checked against the Hub's own LFS sha256 / git blob id, resumable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qconv.fsutil import sha256_bytes, sha256_file
from qconv.hub import cache, resolve_artifact
from qconv.hub.index import Location, add_to_index_file, entry_for_artifact
from qconv.hub.pull import pull
from qconv.manifest import hash_artifact_files, read_manifest
from tests.cli_helpers import run as cli
from tests.hub_server import BIG, SMALL, FakeHub, assert_same_tree, flip_byte, make_artifact

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "org/tiny-w4a16"
LOC = Location("hf", REPO_ID)


class Hub:
    def __init__(self, tmp: Path):
        self.art = make_artifact(tmp / "art" / "tiny-w4a16")
        self.server = FakeHub()
        self.sha = self.server.publish(REPO_ID, self.files(self.art))
        self.home = tmp / "home"

    @staticmethod
    def files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    def resolve_path(self, name: str, sha: str | None = None) -> str:
        return f"/{REPO_ID}/resolve/{sha or self.sha}/{name}"

    def file_gets(self, name: str) -> list[tuple[str, str | None]]:
        """(commit, Range) of every GET of `name` through the resolve endpoint."""
        return [
            (p.split("/")[4], r)
            for m, p, r, _ in self.server.requests
            if m == "GET" and "/resolve/" in p and p.endswith("/" + name)
        ]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hfc

    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", False)  # conftest sets HF_HUB_OFFLINE=1 for every other test
    monkeypatch.setattr(hfc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hfc, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # 10 MB by default: a cut file this small would
    # never have yielded a chunk, so the resume would start at 0 (as it does for the first 10 MB of a real file)
    h = Hub(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", h.server.url)
    monkeypatch.setenv("QCONV_HOME", str(h.home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("QCONV_INDEX", raising=False)
    yield h
    h.server.close()


def _env(h: Hub) -> dict:
    return {
        **os.environ,
        "QCONV_HOME": str(h.home),
        "HF_ENDPOINT": h.server.url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "PYTHONPATH": str(REPO),
    }


def test_pull_from_the_hub_pins_the_commit_and_checks_every_file(hub):
    r = cli("pull", REPO_ID, "-q")
    assert r.exit_code == 0, r.output
    out = Path(r.stdout.strip().splitlines()[-1])
    assert out == cache.revision_dir(LOC, hub.sha) and out.name == hub.sha
    assert_same_tree(out, hub.art)
    assert resolve_artifact(REPO_ID) == out and cli("verify", REPO_ID).exit_code == 0
    gets = [p for m, p, _, _ in hub.server.requests if m == "GET" and "/resolve/" in p]
    assert gets and all(f"/resolve/{hub.sha}/" in p for p in gets)  # files by commit, never by branch name
    assert any(p == f"/api/models/{REPO_ID}" for _, p, _, _ in hub.server.requests)  # the default branch
    assert json.loads((cache.slot_dir(LOC) / "source.json").read_text())["revision"] == hub.sha
    assert not (cache.hf_cache_dir() / "models--org--tiny-w4a16").exists()  # the download cache is gone
    assert "no trusted hash" not in r.stderr  # the Hub's metadata vouches for it
    n = len(hub.server.requests)
    assert cli("pull", REPO_ID, "-q").exit_code == 0  # up to date: one metadata call, no file
    assert [p for _, p, _, _ in hub.server.requests[n:]] == [f"/api/models/{REPO_ID}"]


def test_tampered_lfs_object_is_refused(hub):
    hub.server.b.tamper[hub.resolve_path(BIG)] = -1
    r = cli("pull", REPO_ID, "-q")
    assert r.exit_code == 1, r.output
    good = sha256_file(hub.art / BIG)
    bad = sha256_bytes(flip_byte((hub.art / BIG).read_bytes()))
    assert BIG in r.stderr and good in r.stderr and bad in r.stderr and "Hub" in r.stderr
    assert len(hub.file_gets(BIG)) == 2  # refetched once, then refused
    assert cache.current(LOC) is None and not (cache.slot_dir(LOC) / "revs").exists()
    assert not list(
        cache.hf_cache_dir().glob(f"models--*/blobs/*{good}*")
    )  # the bad blob is not kept under the good name


def test_mirror_serving_a_consistent_rewrite_is_refused(hub):
    """An endpoint that rewrites a shard and qconv.json to match each other still disagrees with the Hub's own
    blob id of qconv.json: refused before any weight is downloaded."""
    evil = flip_byte((hub.art / BIG).read_bytes())
    m = json.loads((hub.art / "qconv.json").read_text())
    m["files"][BIG]["sha256"] = sha256_bytes(evil)
    hub.server.served.update({BIG: evil, "qconv.json": json.dumps(m).encode()})
    r = cli("pull", REPO_ID, "-q")
    assert r.exit_code == 1 and "qconv.json" in r.stderr and "Hub's own hashes" in r.stderr, r.output
    assert hub.file_gets(BIG) == [] and cache.current(LOC) is None


def test_cut_connection_resumes_with_range(hub):
    hub.server.b.cut[hub.resolve_path(BIG)] = 1
    out = pull(REPO_ID, progress=False)
    done = (hub.art / BIG).stat().st_size // 2 // (1 << 16) * (1 << 16)  # whole chunks received before the cut
    assert done > 0 and hub.file_gets(BIG) == [(hub.sha, None), (hub.sha, f"bytes={done}-")]
    assert_same_tree(out, hub.art)


def test_killed_hub_pull_reruns_to_the_same_bytes_and_keeps_finished_files(hub):
    import threading

    release = threading.Event()
    hub.server.b.stall[hub.resolve_path(BIG)] = release
    snap = cache.hf_cache_dir() / "models--org--tiny-w4a16" / "snapshots" / hub.sha
    others = [n for n in hub.files(hub.art) if n != BIG]
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from qconv.hub.pull import pull; pull({REPO_ID!r}, progress=False)"],
        cwd=REPO,
        env=_env(hub),
    )
    try:
        deadline = time.monotonic() + 60
        while not (hub.file_gets(BIG) and all((snap / n).exists() for n in others)):
            assert proc.poll() is None and time.monotonic() < deadline, "pull never reached the stall"
            time.sleep(0.05)
        time.sleep(0.2)  # let the half of BIG land in huggingface_hub's temp file
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        release.set()
    assert list(snap.parent.parent.glob("blobs/*.incomplete")), "the kill should leave huggingface_hub's temp file"
    n = len(hub.server.requests)
    out = pull(REPO_ID, progress=False)
    assert_same_tree(out, hub.art)
    rerun = [p.rsplit("/", 1)[-1] for m, p, _, _ in hub.server.requests[n:] if m == "GET" and "/resolve/" in p]
    assert BIG in rerun and SMALL not in rerun and "config.json" not in rerun  # finished files were kept
    leftovers = [
        p
        for p in (hub.home / "artifacts").rglob("*")
        if p.name.endswith((".incomplete", ".partial")) or ".old-" in p.name
    ]
    assert leftovers == [] and not cache.hf_cache_dir().joinpath("models--org--tiny-w4a16").exists()


def test_moved_branch_is_pinned_by_commit(hub, tmp_path):
    """main moves to a new commit right after our metadata call: the pull still takes every file from the commit it
    resolved (mixing the two would fail the hash checks); the next pull takes the new commit as a new revision."""
    v2 = make_artifact(tmp_path / "v2" / "tiny-w4a16")
    (v2 / SMALL).write_bytes(flip_byte((v2 / SMALL).read_bytes(), at=200))
    m = read_manifest(v2)
    m.files = hash_artifact_files(v2)
    m.write(v2)
    moved = {}

    def move_main(repo, rev):
        if not moved:
            moved["sha"] = hub.server.publish(REPO_ID, hub.files(v2))

    hub.server.after_info = move_main
    first = pull(REPO_ID, progress=False)
    assert moved and first.name == hub.sha
    assert_same_tree(first, hub.art)
    assert {c for c, _ in hub.file_gets(SMALL)} == {hub.sha}
    hub.server.after_info = None
    second = pull(REPO_ID, progress=False)
    assert second.name == moved["sha"] and (second / SMALL).read_bytes() == (v2 / SMALL).read_bytes()
    assert resolve_artifact(REPO_ID) == second and not first.exists()  # nobody held the old revision
    pinned = pull(REPO_ID, revision=hub.sha, progress=False)  # an explicit commit is a revision too
    assert pinned.name == hub.sha and (pinned / SMALL).read_bytes() == (hub.art / SMALL).read_bytes()


def test_hf_token_is_sent_on_every_request(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_qconvtest")
    assert cli("pull", REPO_ID, "-q").exit_code == 0
    assert hub.server.requests and all(a == "Bearer hf_qconvtest" for _, _, _, a in hub.server.requests)


def test_unknown_repo_and_revision_are_clear_errors(hub):
    r = cli("pull", "org/nope", "-q")
    assert r.exit_code == 2 and "not found" in r.stderr and "HF_TOKEN" in r.stderr
    r = cli("pull", REPO_ID, "--revision", "v9", "-q")
    assert r.exit_code == 2 and "no revision 'v9'" in r.stderr


def test_index_entry_on_the_hub(hub, tmp_path):
    """A team index naming a Hub repo: pulled through huggingface_hub, checked against the index and the Hub."""
    idx = tmp_path / "team-index.json"
    add_to_index_file(idx, entry_for_artifact(hub.art, Location("hf", REPO_ID), name="team-tiny"))
    r = cli("pull", "team-tiny", "--index", str(idx), "-q")
    assert r.exit_code == 0, r.output
    assert Path(r.stdout.strip()) == cache.revision_dir(LOC, hub.sha)
    assert resolve_artifact("team-tiny") == resolve_artifact(REPO_ID)  # one slot: same location
    served = cli("serve", "team-tiny", "--backend", "vllm", "--print-command")
    assert served.exit_code == 0 and f"--model {cache.revision_dir(LOC, hub.sha)} " in served.stdout, served.output
