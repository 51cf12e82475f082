"""Fault injection for `qconv pull` (issue 18, Pull): one test per finding, each failing on the code before the fix.

Disk faults are real: a tmpfs the test mounts (root), full or read-only. The server is tests.hub_server's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qconv.hub import cache
from qconv.hub.download import MANIFEST_CAP, http_fetch
from qconv.hub.pull import pull
from tests.cli_helpers import REPO
from tests.cli_helpers import run as cli
from tests.hub_server import BIG, BIG_PATH, NAME, SMALL, Hub, assert_same_tree


def test_fetch_stops_at_the_declared_size(hub, tmp_path):
    """Reproduced: 5,000 bytes written for a file declared as 1,000."""
    (hub.root / "five-k.bin").write_bytes(b"x" * 5000)
    part = tmp_path / "f.part"
    http_fetch(f"{hub.server.url}/five-k.bin", part, 1000, insecure=True, progress=False)
    assert part.stat().st_size == 1000


def test_unhashed_manifest_is_capped(hub):
    """A qconv.json no index vouches for, served without Content-Length and padded past the cap, is refused."""
    m = (hub.art / "qconv.json").read_text()
    (hub.art / "qconv.json").write_text(m[:-2] + " " * (MANIFEST_CAP + 10) + m[-2:])  # still valid JSON
    hub.server.b.no_length.add(f"/artifacts/{NAME}/qconv.json")
    r = cli("pull", hub.art_url, "-q", "--insecure")
    assert r.exit_code == 2 and "larger than" in r.stderr and "qconv.json" in r.stderr, r.output
    assert hub.cached() is None and hub.server.gets(BIG_PATH) == []
    assert not list((hub.home / "artifacts").rglob("qconv.json*"))


def test_free_space_is_checked_before_downloading(hub, tmpfs, monkeypatch):
    home = tmpfs(160)  # the artifact is ~310 KB
    monkeypatch.setenv("QCONV_HOME", str(home))
    r = cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure")
    assert r.exit_code == 2 and "needs about" in r.stderr and "MB free" in r.stderr, r.output
    assert hub.server.gets(BIG_PATH) == []  # refused before any weight was requested


def test_206_with_the_whole_file_is_placed_at_its_content_range(hub):
    """A server that answers the resume's Range with 206 and the whole file (Content-Range: bytes 0-...) used to
    be appended to the partial file, fail the hash and restart from zero."""
    hub.server.b.cut[BIG_PATH] = 1
    hub.server.b.whole206.add(BIG_PATH)
    out = pull(NAME, index=hub.index_url, progress=False, insecure=True)
    half = (hub.art / BIG).stat().st_size // 2
    assert hub.server.gets(BIG_PATH) == [None, f"bytes={half}-"]  # no third, from-zero fetch
    assert (out / BIG).read_bytes() == (hub.art / BIG).read_bytes()


def _publish_v2(hub: Hub) -> None:
    """Replace the served artifact by a new build (one shard changed); the index is not used here."""
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"lm_head.weight": np.ones((64, 256), np.float16)}, str(hub.art / SMALL))
    from qconv.manifest import hash_artifact_files, read_manifest

    m = read_manifest(hub.art)
    m.files = hash_artifact_files(hub.art)
    m.write(hub.art)


def test_repull_keeps_a_held_revision_and_switches_the_pointer(hub):
    """A re-pull used to swap the folder a server was reading; now each revision has its own folder, `current`
    switches atomically, and the old folder goes only once nobody holds it."""
    v1 = pull(hub.art_url, progress=False, insecure=True)
    v1_small = (v1 / SMALL).read_bytes()
    _publish_v2(hub)
    with cache.hold_artifact(hub.art_url) as held:  # what `qconv serve` does for the time it serves
        assert held == v1
        v2 = pull(hub.art_url, progress=False, insecure=True)
        assert v2 != v1 and (v2 / SMALL).read_bytes() == (hub.art / SMALL).read_bytes()
        assert (v1 / SMALL).read_bytes() == v1_small  # the reader's files are untouched
        assert (cache.slot_dir(hub.loc) / "current").is_symlink() and cache.resolve_artifact(hub.art_url) == v2
    pull(hub.art_url, progress=False, insecure=True)  # up to date; sweeps the released revision
    assert not v1.exists() and v2.is_dir() and hub.stray() == []


def test_stale_leftovers_are_swept_at_the_start_of_a_pull(hub):
    root = hub.home / "artifacts"
    old_layout = [root / f".{NAME}.k3j2.partial", root / f".{NAME}.old-4242"]  # a killed build-style atomic swap
    revs = cache.slot_dir(hub.loc) / "revs"
    new_layout = [revs / ".m-0123456789abcdef.x1y2.partial", revs / ".m-0123456789abcdef.old-4242"]
    for d in old_layout + new_layout:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.safetensors").write_bytes(b"\0" * 4096)
    keep = root / ".other-artifact.k3j2.partial"  # another name's leftover is not ours to judge
    keep.mkdir()
    pull(hub.art_url, progress=False, insecure=True)
    assert [d for d in old_layout + new_layout if d.exists()] == [] and keep.is_dir()


def test_disk_full_mid_pull_is_one_clear_error(hub, tmpfs, monkeypatch):
    home = tmpfs(1024)
    monkeypatch.setenv("QCONV_HOME", str(home))
    release = threading.Event()
    hub.server.b.pause[BIG_PATH] = release
    part = cache.incoming_dir(hub.loc) / f"{BIG}.part"
    filler = home / "filler"
    half = (hub.art / BIG).stat().st_size // 2

    def fill_disk_then_release():
        deadline = time.monotonic() + 30
        while not (part.exists() and part.stat().st_size >= half) and time.monotonic() < deadline:
            time.sleep(0.02)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: the disk is full now
            pass
        finally:
            os.close(fd)
            release.set()

    t = threading.Thread(target=fill_disk_then_release)
    t.start()
    r = cli("pull", hub.art_url, "-q", "--insecure")
    t.join()
    assert r.exit_code == 2, r.output
    err = r.stderr
    assert "no space left" in err and "MB free" in err and err.count("error:") == 1 and "Traceback" not in err
    assert "download interrupted" not in err and "it resumes" not in err
    assert hub.cached() is None
    filler.unlink()  # space freed: the rerun finishes from the partial file
    hub.server.log.clear()
    out = pull(hub.art_url, progress=False, insecure=True)
    assert hub.server.gets(BIG_PATH)[-1] is not None  # resumed with a Range
    assert_same_tree(out, hub.art)


def test_read_only_cache_is_one_clear_error(hub, tmpfs, monkeypatch):
    home = tmpfs(1024)
    subprocess.run(["mount", "-o", "remount,ro", str(home)], check=True)
    monkeypatch.setenv("QCONV_HOME", str(home))
    r = cli("pull", hub.art_url, "-q", "--insecure")
    assert r.exit_code == 2 and "read-only file system" in r.stderr and "writable" in r.stderr, r.output
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr and "resumes" not in r.stderr


def test_killed_pull_resumes_to_the_same_bytes_with_no_stray_folders(hub):
    """kill -9 mid-file leaves its .part; the rerun asks only for the rest (Range), ends identical, leaves nothing."""
    release = threading.Event()
    hub.server.b.stall[BIG_PATH] = release
    part = cache.incoming_dir(hub.loc) / f"{BIG}.part"
    half = (hub.art / BIG).stat().st_size // 2
    code = f"from qconv.hub.pull import pull; pull({hub.art_url!r}, progress=False, retries=0, insecure=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "QCONV_HOME": str(hub.home)})
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= half):
            assert proc.poll() is None and time.monotonic() < deadline, "pull never reached the stall"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        release.set()
    assert part.stat().st_size == half and hub.cached() is None
    out = pull(hub.art_url, progress=False, insecure=True)
    assert hub.server.gets(BIG_PATH) == [None, f"bytes={half}-"]
    assert_same_tree(out, hub.art)
    assert hub.stray() == [] and not cache.incoming_dir(hub.loc).exists()


def _edit_manifest(folder: Path, fn) -> None:
    d = json.loads((folder / "qconv.json").read_text())
    fn(d)
    (folder / "qconv.json").write_text(json.dumps(d))


BAD_TABLES = {
    "files is a list": (lambda d: d.update(files=list(d["files"])), "files"),
    "an entry is a string": (lambda d: d["files"].update({BIG: "abc"}), f"files.{BIG}"),
    "size is a word": (lambda d: d["files"][BIG].update(size="big"), f"files.{BIG}.size"),
    "sha256 is not hex": (lambda d: d["files"][BIG].update(sha256="../../x"), f"files.{BIG}.sha256"),
    "no schema_version": (lambda d: (d.clear(), d.update(x=1)), "schema_version"),
}


@pytest.mark.parametrize("case", BAD_TABLES)
def test_wrongly_typed_manifest_is_one_error_naming_the_key(hub, tmp_path, case):
    """verify and pull read qconv.json with the typed reader: one error with the key path, exit 2, and a refused pull
    leaves no `.incoming/*/qconv.json` behind."""
    edit, key = BAD_TABLES[case]
    art = shutil.copytree(hub.art, tmp_path / "art")
    _edit_manifest(art, edit)
    r = cli("verify", art)
    assert r.exit_code == 2 and key in r.stderr and "fix:" in r.stderr, r.output
    _edit_manifest(hub.art, edit)
    r = cli("pull", hub.art_url, "-q", "--insecure")
    assert r.exit_code == 2 and key in r.stderr, r.output
    assert not list((hub.home / "artifacts").rglob("qconv.json*"))


def test_pull_never_writes_through_a_link_planted_in_the_cache(hub, tmp_path):
    """A `.part` in the download folder that links elsewhere: the pull refuses it, the other file is untouched and
    nothing of the artifact becomes visible."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    staging = cache.incoming_dir(cache.target_location(str(hub.art)))
    staging.mkdir(parents=True)
    (staging / "tokenizer.json.part").symlink_to(victim)
    r = cli("pull", hub.art, "-q")
    assert r.exit_code == 2 and "symbolic link" in r.stderr and "tokenizer.json.part" in r.stderr, r.output
    assert victim.read_text() == "precious"
    assert cache.current(cache.target_location(str(hub.art))) is None
    assert not list(staging.glob("qconv.json*"))
    (staging / "tokenizer.json.part").unlink()  # the fix the error names: remove the link, pull again
    assert cli("pull", hub.art, "-q").exit_code == 0 and victim.read_text() == "precious"


def test_verify_and_pull_refuse_links_out_of_the_artifact(hub, tmp_path):
    """An artifact's files are regular files inside it: a listed file that links outside, or a linked folder, is
    reported by verify (exit 1) and refused by pull, whose cache never gets the outside bytes."""
    art = shutil.copytree(hub.art, tmp_path / "art")
    outside = tmp_path / "outside.json"
    shutil.copy(art / "tokenizer.json", outside)
    (art / "tokenizer.json").unlink()
    (art / "tokenizer.json").symlink_to(outside)
    r = cli("verify", art)
    assert r.exit_code == 1 and "tokenizer.json: a symbolic link" in r.stderr, r.output
    r = cli("pull", art, "-q")
    assert r.exit_code == 2 and "symbolic link" in r.stderr and "tokenizer.json" in r.stderr, r.output
    assert cache.current(cache.target_location(str(art))) is None

    art2 = shutil.copytree(hub.art, tmp_path / "art2")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.txt").write_text("x")
    (art2 / "extra").symlink_to(tmp_path / "elsewhere")
    r = cli("verify", art2)
    assert r.exit_code == 1 and "extra: a symbolic link" in r.stderr, r.output


@pytest.mark.parametrize("where", ["slot", "revs", "incoming"])
def test_pull_refuses_a_linked_cache_folder(hub, tmp_path, where):
    """A link planted as the artifact's cache folder, its `revs` folder or its download folder used to receive the
    whole revision, source.json and `current`: now one error naming the link, and nothing is written where it
    points."""
    elsewhere = tmp_path / "X"
    elsewhere.mkdir()
    planted = {
        "slot": cache.slot_dir(hub.loc),
        "revs": cache.slot_dir(hub.loc) / "revs",
        "incoming": cache.incoming_dir(hub.loc),
    }[where]
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(elsewhere)
    r = cli("pull", NAME, "--index", hub.index_file, "-q", "--insecure")
    assert r.exit_code == 2 and "symbolic link" in r.stderr and str(planted) in r.stderr, r.output
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr
    assert list(elsewhere.iterdir()) == []
    planted.unlink()  # the fix the error names
    assert cli("pull", NAME, "--index", hub.index_file, "-q", "--insecure").exit_code == 0
    assert list(elsewhere.iterdir()) == [] and hub.cached() is not None


def test_a_planted_current_pointer_is_not_followed(hub, tmp_path):
    """`current` must point into the slot's revs/: a pointer planted elsewhere is not served, and a pull refuses it."""
    out = pull(hub.art_url, progress=False, insecure=True)
    fake = shutil.copytree(out, tmp_path / "fake")
    link = cache.slot_dir(hub.loc) / "current"
    link.unlink()
    link.symlink_to(fake)
    assert cache.current(hub.loc) is None
    r = cli("pull", hub.art_url, "-q", "--insecure")
    assert r.exit_code == 2 and "outside the slot" in r.stderr, r.output


@pytest.mark.parametrize("name", ["config.json.part", "config.json"])
def test_pull_never_writes_through_a_hard_link_in_the_download_folder(hub, tmp_path, name):
    """A hard link planted as `.incoming/<key>/config.json.part` used to be truncated and filled (the victim
    overwritten, the cached file sharing its inode); one planted as a finished file would be moved into the cache."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    loc = cache.target_location(str(hub.art))
    staging = cache.incoming_dir(loc)
    staging.mkdir(parents=True)
    os.link(victim, staging / name)
    r = cli("pull", hub.art, "-q")
    assert r.exit_code == 2 and "hard link" in r.stderr and name in r.stderr, r.output
    assert victim.read_text() == "precious" and victim.stat().st_nlink == 2
    assert cache.current(loc) is None
    (staging / name).unlink()
    assert cli("pull", hub.art, "-q").exit_code == 0 and victim.read_text() == "precious"
    assert victim.stat().st_nlink == 1


def test_open_for_a_part_file_refuses_hard_links_and_fifos(tmp_path):
    from qconv.errors import QconvError
    from qconv.fsutil import open_nofollow

    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.link(victim, tmp_path / "hard.part")
    os.mkfifo(tmp_path / "fifo.part")
    for name in ("hard.part", "fifo.part"):
        with pytest.raises(QconvError, match="hard link|not a regular file"):
            open_nofollow(tmp_path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "pulling", "fix")
    assert victim.read_text() == "precious"


def _index_with(hub: Hub, tmp_path: Path, location: dict) -> Path:
    d = json.loads(hub.index_file.read_text())
    d["artifacts"][0]["location"] = location
    idx = tmp_path / "idx.json"
    idx.write_text(json.dumps(d))
    return idx


def test_a_deeply_nested_index_is_one_error(hub, tmp_path):
    """`'[' * 100000 + ']' * 100000` (200 KB) as the index: a RecursionError traceback from json.loads."""
    idx = tmp_path / "idx.json"
    idx.write_text("[" * 100_000 + "]" * 100_000)
    r = cli("pull", NAME, "--index", idx, "-q")
    assert r.exit_code == 2 and "artifact index is not valid JSON" in r.stderr and str(idx) in r.stderr, r.output
    idx.write_text('{"schema_version": 1, "artifacts": [], "x": ' + "9" * 5000 + "}")  # an over-long integer
    assert cli("pull", NAME, "--index", idx, "-q").exit_code == 2


def test_a_local_index_has_the_remote_size_cap(hub, tmp_path, monkeypatch):
    from qconv.hub import index

    monkeypatch.setattr(index, "INDEX_CAP", 1000)
    idx = tmp_path / "idx.json"
    idx.write_text(json.dumps({"schema_version": 1, "artifacts": [], "pad": "x" * 2000}))
    r = cli("pull", NAME, "--index", idx, "-q")
    assert r.exit_code == 2 and "artifact index larger than" in r.stderr, r.output


@pytest.mark.parametrize("scheme", ["file", "ftp"])
def test_an_index_url_location_is_https_only(hub, tmp_path, scheme):
    """A `url` location of file:///… used to be fetched by urllib (through a symlinked tokenizer.json the `path`
    kind refuses), and ftp:// went in plain text without --insecure; a local error was retried as "download
    interrupted". Now the index itself is refused, naming the location, before anything is fetched."""
    uri = f"file://{hub.art}" if scheme == "file" else "ftp://127.0.0.1/artifacts/" + NAME
    idx = _index_with(hub, tmp_path, {"kind": "url", "uri": uri})
    r = cli("pull", NAME, "--index", idx, "-q", "--insecure")
    assert r.exit_code == 2 and "location kind 'url' takes an https:// URL" in r.stderr, r.output
    assert "interrupted" not in r.stderr and hub.cached() is None


def test_a_file_url_path_location_gets_the_path_kinds_link_refusals(hub, tmp_path):
    art = shutil.copytree(hub.art, tmp_path / "art")
    outside = tmp_path / "outside.json"
    shutil.copy(art / "tokenizer.json", outside)
    (art / "tokenizer.json").unlink()
    (art / "tokenizer.json").symlink_to(outside)
    idx = _index_with(hub, tmp_path, {"kind": "path", "uri": f"file://{art}"})
    r = cli("pull", NAME, "--index", idx, "-q")
    assert r.exit_code == 2 and "symbolic link" in r.stderr and "tokenizer.json" in r.stderr, r.output
    (art / "tokenizer.json").unlink()
    shutil.copy(outside, art / "tokenizer.json")
    assert cli("pull", NAME, "--index", idx, "-q").exit_code == 0


def test_http_fetch_refuses_anything_but_http(tmp_path):
    from qconv.errors import QconvError

    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x"):
        with pytest.raises(QconvError, match="fetched over https:// only"):
            http_fetch(url, tmp_path / "x.part", None, insecure=True, progress=False)
    assert not (tmp_path / "x.part").exists()


def test_the_index_entry_wins_over_a_folder_of_its_name(hub, tmp_path, monkeypatch):
    """`qconv pull NAME --index …` in a folder holding a folder NAME pulled that folder, losing the index's hashes,
    with only a warning."""
    decoy = shutil.copytree(hub.art, tmp_path / "cwd" / NAME)
    (decoy / "tokenizer.json").write_text('{"decoy": true}')
    from qconv.manifest import hash_artifact_files, read_manifest

    m = read_manifest(decoy)
    m.files = hash_artifact_files(decoy)
    m.write(decoy)
    monkeypatch.chdir(tmp_path / "cwd")
    out = pull(NAME, index=str(hub.index_file), progress=False, insecure=True)
    assert out == hub.cached() and (out / "tokenizer.json").read_bytes() == (hub.art / "tokenizer.json").read_bytes()
    mine = pull(f"./{NAME}", progress=False)  # the folder, when asked for as a path
    assert (mine / "tokenizer.json").read_text() == '{"decoy": true}'


def test_a_refused_pull_leaves_no_manifest_in_incoming(hub):
    hub.edit_index(lambda e: e["files"][BIG].update(size=e["files"][BIG]["size"] + 1))  # index and qconv.json disagree
    r = cli("pull", NAME, "--index", hub.index_file, "-q", "--insecure")
    assert r.exit_code == 1 and "disagree" in r.stderr, r.output
    assert not list((hub.home / "artifacts").rglob("qconv.json*"))


def test_a_local_pull_checks_sizes_before_copying(hub, tmp_path, monkeypatch):
    """A local pull copied a 3 GB qconv.json before the size limit refused it (here: one byte over the cap, sparse)."""
    from qconv.hub import download

    copied = []
    real = download.shutil.copyfileobj
    monkeypatch.setattr(download.shutil, "copyfileobj", lambda *a, **k: (copied.append(1), real(*a, **k)))
    art = shutil.copytree(hub.art, tmp_path / "art")
    with open(art / "qconv.json", "ab") as f:
        f.truncate(MANIFEST_CAP + 1)  # sparse: no real bytes
    r = cli("pull", art, "-q")
    assert r.exit_code == 2 and "refusing a qconv.json of" in r.stderr and copied == [], r.output
    assert not list((hub.home / "artifacts").rglob("qconv.json*"))


def test_a_local_error_while_fetching_is_not_retried(hub, tmp_path, monkeypatch):
    """A local filesystem error inside the fetch loop is the disk's: one error at once, never "download interrupted"
    retried."""
    from qconv.errors import QconvError
    from qconv.hub import download

    part = tmp_path / "x.part"
    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise PermissionError(13, "Permission denied", str(part))

    monkeypatch.setattr(download, "_write_body", refuse)
    with pytest.raises(QconvError) as e:
        http_fetch(f"{hub.art_url}/tokenizer.json", part, None, insecure=True, progress=False, retries=3)
    assert "permission denied" in str(e.value) and "interrupted" not in str(e.value) and calls == [1]
