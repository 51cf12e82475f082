"""Prebuilt artifacts against a real HTTP server on 127.0.0.1: pull, resume, tamper, refuse, lock, verify, push."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from qconv.errors import QconvError
from qconv.fsutil import sha256_bytes, sha256_file
from qconv.hub import cache, resolve_artifact
from qconv.hub.index import Location, add_to_index_file, entry_for_artifact, load_index
from qconv.hub.pull import pull
from qconv.manifest import read_manifest
from tests.cli_helpers import REPO
from tests.cli_helpers import run as cli
from tests.hub_server import BIG, BIG_PATH, NAME, SMALL, assert_same_tree, flip_byte, make_artifact


def test_shipped_index_is_valid(monkeypatch):
    monkeypatch.delenv("QCONV_INDEX", raising=False)
    idx = load_index()
    assert idx.schema_version == 1 and isinstance(idx.artifacts, list)


def test_pull_by_name_verifies_and_lists(hub, monkeypatch):
    r = cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure")
    assert r.exit_code == 0, r.output
    out = Path(r.stdout.strip().splitlines()[-1])
    assert out == hub.cached() and out.is_dir()
    assert_same_tree(out, hub.art)
    assert not cache.incoming_dir(hub.loc).exists() and hub.stray() == []
    assert cli("verify", NAME).exit_code == 0
    assert resolve_artifact(NAME) == out
    lst = cli("list").stdout
    assert NAME in lst and "3090" in lst and str(out) in lst
    monkeypatch.setenv("QCONV_INDEX", hub.index_url)  # env var picks the index too
    remote = cli("list", "--remote", "--insecure").stdout
    assert NAME in remote and hub.art_url in remote and "yes" in remote
    n_before = len(hub.server.gets(BIG_PATH))
    assert cli("pull", NAME, "-q", "--insecure").exit_code == 0  # up to date: only qconv.json is fetched again
    assert len(hub.server.gets(BIG_PATH)) == n_before


def test_pull_url_without_index(hub):
    r = cli("pull", hub.art_url + "/", "-q", "--insecure")
    assert r.exit_code == 0, r.output
    assert_same_tree(hub.cached(), hub.art)


def test_cut_download_resumes_with_range(hub):
    hub.server.b.cut[BIG_PATH] = 1
    out = pull(NAME, index=hub.index_url, progress=False, insecure=True)
    ranges = hub.server.gets(BIG_PATH)
    half = (hub.art / BIG).stat().st_size // 2
    assert ranges == [None, f"bytes={half}-"]
    assert (out / BIG).read_bytes() == (hub.art / BIG).read_bytes()


def test_tampered_file_is_refetched(hub):
    hub.server.b.tamper[BIG_PATH] = 1
    out = pull(NAME, index=hub.index_url, progress=False, insecure=True)
    assert hub.server.gets(BIG_PATH) == [None, None]
    assert sha256_file(out / BIG) == sha256_file(hub.art / BIG)


def test_permanently_tampered_file_fails_with_both_hashes(hub):
    hub.server.b.tamper[BIG_PATH] = -1
    r = cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure")
    assert r.exit_code == 1
    good = sha256_file(hub.art / BIG)
    bad = sha256_bytes(flip_byte((hub.art / BIG).read_bytes()))
    assert BIG in r.stderr and good in r.stderr and bad in r.stderr
    assert len(hub.server.gets(BIG_PATH)) == 2  # detected, fetched once more, then refused
    assert hub.cached() is None


@pytest.mark.parametrize(
    "bad", ["../evil.safetensors", "/etc/evil.safetensors", "sub\\..\\..\\evil.safetensors", "a/../../evil.json"]
)
def test_escaping_names_are_refused(hub, bad):
    hub.edit_index(lambda e: e["files"].update({bad: {"sha256": "0" * 64, "size": 1}}))
    r = cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure")
    assert r.exit_code == 2 and "escapes the artifact folder" in r.stderr and repr(bad) in r.stderr
    assert hub.server.gets(BIG_PATH) == []  # refused before any download
    assert not (hub.home / "evil.safetensors").exists() and not (hub.home / "artifacts" / "evil.json").exists()


def test_escaping_name_in_manifest_is_refused(hub):
    m = json.loads((hub.art / "qconv.json").read_text())
    m["files"]["../../evil.json"] = {"sha256": "0" * 64, "size": 1}
    (hub.art / "qconv.json").write_text(json.dumps(m))
    r = cli("pull", hub.art_url, "-q", "--insecure")  # no index: the manifest's own table is checked
    assert r.exit_code == 2 and "'../../evil.json'" in r.stderr and "escapes" in r.stderr
    assert hub.server.gets(BIG_PATH) == []


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "weights.pth", "x.pkl"])
def test_pickle_weights_are_refused(hub, weights):
    hub.edit_index(lambda e: e["files"].update({weights: {"sha256": "0" * 64, "size": 1}}))
    r = cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure")
    assert r.exit_code == 2 and "pickle" in r.stderr and weights in r.stderr


def test_concurrent_pulls_end_with_one_good_copy(hub):
    hub.server.b.delay[BIG_PATH] = 0.3  # make the two pulls overlap
    start, results = threading.Barrier(2), []

    def run():
        start.wait()
        results.append(pull(NAME, index=hub.index_url, progress=False, insecure=True))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [hub.cached(), hub.cached()]
    assert len(hub.server.gets(BIG_PATH)) == 1  # the second pull waited on the lock and found it done
    assert_same_tree(hub.cached(), hub.art)
    assert hub.stray() == []


def test_verify_flags_one_flipped_byte(hub, tmp_path):
    art = shutil.copytree(hub.art, tmp_path / "art")
    ok = cli("verify", str(art))
    assert ok.exit_code == 0 and "verified" in ok.stdout
    kld = read_manifest(art).quality.weights.kld_mean
    assert "weights.kld_mean" in ok.stdout and f"{kld:.6g}" in ok.stdout and "recipe:   3090" in ok.stdout
    (art / SMALL).write_bytes(flip_byte((art / SMALL).read_bytes(), at=100))
    r = cli("verify", str(art))
    assert r.exit_code == 1 and SMALL in r.stderr and BIG not in r.stderr


def test_verify_rejects_bad_manifest_schema(hub, tmp_path):
    art = shutil.copytree(hub.art, tmp_path / "art")
    m = json.loads((art / "qconv.json").read_text())
    del m["recipe"]
    (art / "qconv.json").write_text(json.dumps(m))
    r = cli("verify", str(art))
    assert r.exit_code == 2 and "malformed manifest" in r.stderr


def test_offline_pull_uses_cache_or_fails_clearly(hub):
    missing = cli("pull", "--offline", NAME)
    assert missing.exit_code == 2 and "not in the cache" in missing.stderr
    assert hub.server.log == []
    pulled = pull(NAME, index=hub.index_url, progress=False, insecure=True)
    hub.server.close()  # no network from here on
    r = cli("pull", "--offline", NAME)
    assert r.exit_code == 0 and r.stdout.strip() == str(pulled)
    assert resolve_artifact(NAME) == pulled and resolve_artifact(str(hub.art)) == hub.art.resolve()
    served = cli("serve", NAME, "--backend", "vllm", "--print-command")  # `qconv serve NAME` from the cache alone
    assert served.exit_code == 0 and f"--model {pulled} " in served.stdout, served.output
    assert cli("verify", "no-such-artifact").exit_code == 2


def test_unknown_name_and_bad_index(hub, tmp_path):
    r = cli("pull", "nope", "--index", hub.index_url, "--insecure")
    assert r.exit_code == 2 and "unknown artifact 'nope'" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1, "artifacts": [{"name": "x", "recipe": "r"}]}))
    r = cli("list", "--remote", "--index", str(bad))
    assert r.exit_code == 2 and "missing key 'location'" in r.stderr and "[x]" in r.stderr


def test_stale_index_disagreeing_with_manifest_fails(hub):
    hub.edit_index(lambda e: e["files"][SMALL].update(size=e["files"][SMALL]["size"] + 1))
    r = cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure")
    assert r.exit_code == 1 and "disagree" in r.stderr and hub.cached() is None


def test_index_add_cli(hub, tmp_path):
    idx = tmp_path / "idx.json"
    r = cli("index", "add", str(hub.art), "--index", str(idx), "--location", "hf:org/tiny@v2", "--name", "tiny2")
    assert r.exit_code == 0, r.output
    e = load_index(str(idx)).get("tiny2")
    assert e.location == Location("hf", "org/tiny", "v2") and e.recipe == "3090"
    assert e.source.id == "Qwen/Qwen3-Tiny" and e.quality == read_manifest(hub.art).quality.data
    assert e.files["qconv.json"].sha256 == sha256_file(hub.art / "qconv.json") and BIG in e.files
    printed = json.loads(cli("index", "add", str(hub.art)).stdout)
    assert printed["location"] == {"kind": "path", "uri": str(hub.art.resolve()), "revision": None}


def test_pull_local_folder_location(hub, tmp_path):
    idx = tmp_path / "idx.json"
    add_to_index_file(idx, entry_for_artifact(hub.art, Location("path", str(hub.art)), name="local-one"))
    out = pull("local-one", index=str(idx), progress=False)
    assert_same_tree(out, hub.art)
    assert resolve_artifact("local-one") == out  # the pulled revision is known by its index name


def test_push_uploads_with_model_card(hub, monkeypatch):
    from huggingface_hub import HfApi

    seen = {}

    def create_repo(self, repo_id, **kw):
        seen["create"] = (repo_id, kw)

    def upload_folder(self, **kw):
        folder = Path(kw["folder_path"])
        seen["upload"] = kw
        seen["files"] = {p.relative_to(folder).as_posix(): sha256_file(p) for p in folder.rglob("*") if p.is_file()}
        seen["card"] = (folder / "README.md").read_text()
        return type("CommitInfo", (), {"commit_url": f"https://hf.co/{kw['repo_id']}/commit/1"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    before = sorted(p.name for p in hub.art.iterdir())
    r = cli("push", str(hub.art), "--repo", "me/tiny-w4a16", "--private")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "https://hf.co/me/tiny-w4a16/commit/1"
    assert seen["create"] == ("me/tiny-w4a16", {"private": True, "exist_ok": True, "repo_type": "model"})
    up = seen["upload"]
    assert up["repo_id"] == "me/tiny-w4a16" and up["repo_type"] == "model" and up["revision"] is None
    assert not Path(up["folder_path"]).exists()  # staging removed
    want = {p.name: sha256_file(p) for p in hub.art.iterdir()}
    assert {k: v for k, v in seen["files"].items() if k != "README.md"} == want
    card, q = seen["card"], read_manifest(hub.art).quality
    for s in (
        "base_model: Qwen/Qwen3-Tiny",
        "recipe | `3090`",
        "`0123abc`",
        f"| weights.kld_mean | {q.weights.kld_mean:.6g} |",
        f"| weights.top1 | {q.weights.top1:.6g} |",
        "| passed | True |",
        "qconv pull me/tiny-w4a16",
        "qconv serve me/tiny-w4a16",
        "vllm serve me/tiny-w4a16",
    ):
        assert s in card, s
    assert sorted(p.name for p in hub.art.iterdir()) == before  # the artifact itself is untouched

    (hub.art / BIG).write_bytes(flip_byte((hub.art / BIG).read_bytes()))
    seen.clear()
    r = cli("push", str(hub.art), "--repo", "me/tiny-w4a16")
    assert r.exit_code == 1 and BIG in r.stderr and seen == {}  # never uploads a corrupt artifact


def test_readme_publishing_example_runs_offline(tmp_path, monkeypatch):
    """docs/HUB.md's shared-folder example, line by line, with /mnt/team under tmp and no network."""
    import re
    import shlex

    text = (REPO / "docs" / "HUB.md").read_text()
    block = re.search(r"## Publishing for a team.*?```\n(.*?)```", text, re.S)[1]
    team = tmp_path / "team"
    (team / "models").mkdir(parents=True)
    make_artifact(tmp_path / "work" / "my-27b-3090")
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QCONV_INDEX", raising=False)
    outputs = []
    for line in block.strip().splitlines():
        argv = shlex.split(line.replace("/mnt/team", str(team)))
        if argv[0] == "cp":
            subprocess.run(argv, check=True)
            continue
        assert argv[0] == "qconv", line
        r = cli(*argv[1:])
        assert r.exit_code == 0, (line, r.output)
        outputs.append(r.stdout)
    assert "my-27b-3090" in outputs[1] and "27B for one 3090" not in outputs[1]  # list --remote shows the entry
    pulled = Path(outputs[2].strip())
    assert_same_tree(pulled, team / "models" / "my-27b-3090")
    assert "verified" in outputs[3]
    assert "no trusted hash" not in "".join(outputs)


def test_cache_slots_are_keyed_by_source(hub, tmp_path, monkeypatch):
    """A URL and a folder with the same last name get separate slots; a name resolves only to a copy pulled from
    the location its index names."""
    folder = shutil.copytree(hub.art, tmp_path / "elsewhere" / NAME)
    from_url = pull(hub.art_url, progress=False, insecure=True)
    from_folder = pull(str(folder), progress=False)
    assert from_url.parent.parent != from_folder.parent.parent
    assert resolve_artifact(hub.art_url) == from_url and cache.current(Location("path", str(folder))) == from_folder
    idx = tmp_path / "idx.json"
    add_to_index_file(idx, entry_for_artifact(folder, Location("path", str(folder)), name="team-tiny"))
    assert pull("team-tiny", index=str(idx), progress=False) == from_folder  # same location, same slot
    monkeypatch.setenv("QCONV_INDEX", str(idx))
    assert resolve_artifact("team-tiny") == from_folder
    moved = shutil.copytree(hub.art, tmp_path / "moved" / NAME)
    idx.unlink()
    add_to_index_file(idx, entry_for_artifact(moved, Location("path", str(moved)), name="team-tiny"))
    with pytest.raises(QconvError, match="not in the cache"):  # the index now names a location never pulled
        resolve_artifact("team-tiny")


def test_untrusted_pull_says_so_once(hub, caplog):
    def warned() -> int:
        return sum("no trusted hash" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)

    assert cli("pull", hub.art_url, "-q", "--insecure").exit_code == 0 and warned() == 1
    caplog.clear()
    assert cli("pull", NAME, "--index", hub.index_url, "-q", "--insecure").exit_code == 0 and warned() == 0


def test_plain_http_needs_insecure(hub):
    for args in (
        ["pull", hub.art_url],
        ["pull", NAME, "--index", hub.index_url],
        ["list", "--remote", "--index", hub.index_url],
    ):
        r = cli(*args)
        assert r.exit_code == 2 and "http://" in r.stderr and "--insecure" in r.stderr, r.output
    assert hub.server.log == []
