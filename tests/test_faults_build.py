"""Fault injection for `qconv build` (issue 18, Build): an unsafe --out, two builds of one source at once, crash
leftovers, fsync before rename, a full disk / refused write mid-build (a real tmpfs), tampered stage folders and
source files, and kill -9 at random points. Each test failed on the code before its fix (see the branch's notes)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from qconv.fsutil import file_table
from tests import cli_helpers
from tests.cli_helpers import FAST_CAL

REPO = Path(__file__).resolve().parents[1]


def run(*args):
    """The CLI in-process; an escaping exception is a failure of the one-clear-error rule, kept in r.exception."""
    from qconv.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def one_error(r, pattern: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, r.output), r.output


@pytest.fixture
def src(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny model (tests here try to destroy it)."""
    p = tmp_path / "src"
    shutil.copytree(tiny_llama, p)
    return p


def build_args(src: Path, out: Path, work: Path, cal: Path, *extra) -> list:
    return [*cli_helpers.build_args("3090", src, out), "--work-dir", work, "--dataset", cal, *FAST_CAL, *extra]


def stage_results(work: Path) -> list[str]:
    return sorted(p.name for p in work.glob("*-*")) if work.is_dir() else []


def strays(folder: Path) -> list[str]:
    """Hidden leftovers (temp, parked, offload folders and temp files) anywhere below folder."""
    return sorted(str(p) for p in folder.rglob(".*") if p.name not in (".lock", ".qconv-stage-done"))


# ---- --out / --force safety --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["source", "inside_source", "parent_of_source", "work_dir", "reference_cache", "dot", "root", "foreign_folder"],
)
def test_out_that_could_destroy_data_is_refused_before_any_work(case, src, tmp_path, calib_txt, monkeypatch):
    from qconv.paths import qconv_home

    work = tmp_path / "work"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    out = {
        "source": src,
        "inside_source": src / "out",
        "parent_of_source": tmp_path,
        "work_dir": work,
        "reference_cache": qconv_home() / "reference" / "x",
        "dot": Path("."),
        "root": Path("/"),
        "foreign_folder": mine,
    }[case]
    if case == "dot":
        monkeypatch.chdir(mine)
    before = file_table(src)
    r = run(*build_args(src, out, work, calib_txt, "--force"))
    one_error(r, r"could destroy|file system root|not empty and holds no qconv\.json")
    assert file_table(src) == before
    assert (mine / "thesis.txt").read_text() == "years of work" and len(list(mine.iterdir())) == 1
    assert stage_results(work) == []  # refused before any work


def test_force_replaces_an_empty_folder_or_an_artifact(src, tmp_path, calib_txt):
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    assert run(*build_args(src, out, work, calib_txt, "--force")).exit_code == 0
    r = run(*build_args(src, out, work, calib_txt, "--force"))  # holds a qconv.json now
    assert r.exit_code == 0, r.output
    assert strays(tmp_path / "out") == [] and not list(tmp_path.glob(".out.*"))


# ---- two builds of one source -----------------------------------------------------------------------------------


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "qconv.cli", *map(str, args)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_second_build_of_a_source_waits_instead_of_deleting_the_first_ones_stage(src, tmp_path, calib_txt):
    """Build A is frozen (SIGSTOP) while its quantization stage is half-written; build B of the same source and work
    dir must leave that folder alone (it waits for the work dir's lock), and both finish with the same artifact."""
    work = tmp_path / "work"
    a = subprocess.Popen(
        _cli(*build_args(src, tmp_path / "A", work, calib_txt)),
        env=_env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    partial = None
    while partial is None and a.poll() is None:
        partial = next((p for p in work.glob(".quantization-*.partial")), None) if work.is_dir() else None
        time.sleep(0.01)
    assert partial is not None, "build A finished before its quantization stage was seen"
    os.kill(a.pid, signal.SIGSTOP)
    log_b = tmp_path / "b.log"
    with open(log_b, "w") as f:
        b = subprocess.Popen(
            _cli(*build_args(src, tmp_path / "B", work, calib_txt)), env=_env(), stderr=f, stdout=subprocess.DEVNULL
        )
    try:
        while b.poll() is None and "in use by another build" not in log_b.read_text():
            time.sleep(0.1)
        assert partial.is_dir(), "build B deleted build A's in-progress stage folder"
    finally:
        os.kill(a.pid, signal.SIGCONT)
    _, err_a = a.communicate(timeout=600)
    assert a.returncode == 0, err_a
    assert b.wait(timeout=600) == 0, log_b.read_text()
    assert "quantization" in log_b.read_text() and "reused from the work dir" in log_b.read_text()
    files = [json.loads((tmp_path / n / "qconv.json").read_text())["files"] for n in "AB"]
    assert files[0] == files[1] and strays(work) == []


# ---- crash leftovers --------------------------------------------------------------------------------------------

CRASH_IN_TEMP = """
import os, signal, sys
from qconv.fsutil import atomic_dir
with atomic_dir(sys.argv[1], force=True) as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 100000)
    os.kill(os.getpid(), signal.SIGKILL)
"""
CRASH_BETWEEN_RENAMES = """
import os, signal, sys
from qconv.fsutil import atomic_dir
real, calls = os.replace, []
def replace(a, b):
    calls.append(a)
    if len(calls) == 2:  # the old folder is parked, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
    real(a, b)
os.replace = replace
with atomic_dir(sys.argv[1], force=True) as tmp:
    (tmp / "new.txt").write_text("new")
"""
CRASH_IN_STAGE = """
import os, signal, sys
from qconv.build.workdir import WorkDir
with WorkDir(sys.argv[1]).new_dir("quantization", "deadbeef") as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 100000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _crash(script: str, arg: Path) -> None:
    r = subprocess.run([sys.executable, "-c", script, str(arg)], env=_env())
    assert r.returncode == -signal.SIGKILL


def test_crash_leftovers_are_swept_and_a_parked_folder_comes_back(src, tmp_path, calib_txt):
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    (out / "qconv.json").write_text("{}")
    (out / "old.txt").write_text("the user's previous artifact")
    _crash(CRASH_BETWEEN_RENAMES, out)
    assert not out.exists() and list(tmp_path.glob(".out.old-*"))  # the crash window the issue names
    _crash(CRASH_IN_TEMP, out)
    _crash(CRASH_IN_STAGE, work)
    assert list(tmp_path.glob(".out.*.partial")) and list(work.glob(".quantization-*.partial"))
    # a build that fails on its input still puts the user's folder back and clears the temp folders
    r = run(*build_args(tmp_path / "no-such-model", out, work, calib_txt, "--force"))
    assert r.exit_code == 2
    assert (out / "old.txt").read_text() == "the user's previous artifact"
    assert not list(tmp_path.glob(".out.*"))
    r = run(*build_args(src, out, work, calib_txt, "--force"))
    assert r.exit_code == 0, r.output
    assert not (out / "old.txt").exists() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".out.*")) and strays(work) == []


def test_files_and_folders_are_flushed_before_the_rename(tmp_path, monkeypatch):
    from qconv.build.workdir import WorkDir
    from qconv.fsutil import atomic_dir, write_text_atomic

    synced, real_fsync = [], os.fsync
    problems = []
    real_replace = os.replace

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(a, b):
        a = Path(a).resolve()
        files = [a] if a.is_file() else [a, *a.rglob("*")]
        problems.extend(str(p) for p in files if str(p) not in synced)
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with atomic_dir(tmp_path / "art") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"w" * 1000)
        (tmp / "config.json").write_text("{}")
    write_text_atomic(tmp_path / "x.json", "{}")
    with WorkDir(tmp_path / "work").new_dir("quantization", "k") as tmp:
        (tmp / "model.safetensors").write_bytes(b"q" * 1000)
    assert problems == []
    assert str(tmp_path.resolve()) in synced  # the folder holding a rename is flushed too


# ---- disk full / permission denied ------------------------------------------------------------------------------


def _fill(folder: Path, leave: int = 32 * 1024) -> None:
    """Fill the file system holding folder until only `leave` bytes are free (another process filling the disk)."""
    free = shutil.disk_usage(folder).free
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def _quantize_then(monkeypatch, before=None, after=None):
    import qconv.convert.quantize as q

    real = q.quantize

    def quantize(*a, **kw):
        if before:
            before()
        out = real(*a, **kw)
        if after:
            after()
        return out

    monkeypatch.setattr(q, "quantize", quantize)


def test_full_disk_is_refused_before_any_work(src, tmp_path, calib_txt, tmpfs):
    small = tmpfs(64)
    work = tmp_path / "work"
    r = run(*build_args(src, small / "out", work, calib_txt))
    one_error(r, r"not enough disk space \(needs about [\d.]+ MB, [\d.]+ MB free\)")
    assert str(small) in r.output and list(small.iterdir()) == [] and stage_results(work) == []


@pytest.mark.parametrize("where", ["out", "work"])
def test_disk_full_mid_build_is_one_error_and_nothing_half_written(where, src, tmp_path, calib_txt, tmpfs, monkeypatch):
    disk = tmpfs(16 * 1024)
    out = (disk if where == "out" else tmp_path) / "out"
    work = (disk if where == "work" else tmp_path) / "work"
    if where == "out":  # the disk fills while the model is being quantized: packaging the artifact fails
        _quantize_then(monkeypatch, after=lambda: _fill(disk))
    else:  # it fills before the quantization stage saves its folder (safetensors reports "os error 28")
        _quantize_then(monkeypatch, before=lambda: _fill(disk))
    r = run(*build_args(src, out, work, calib_txt))
    one_error(r, r"no space left on the device \(needs about [\d.]+ MB, [\d.]+ MB free\)")
    assert not out.exists() and not list(out.parent.glob(".out.*"))
    assert strays(work) == [] and (where == "out" or not list(work.glob("quantization-*")))
    assert sorted(p.name for p in disk.iterdir()) in (["filler"], ["filler", "work"])


def test_read_only_out_is_refused_before_any_work(src, tmp_path, calib_txt, tmpfs):
    ro = tmpfs(1024, "ro")
    r = run(*build_args(src, ro / "out", tmp_path / "work", calib_txt))
    one_error(r, r"read-only file system")
    assert stage_results(tmp_path / "work") == []


def test_permission_denied_mid_build_is_one_error(src, tmp_path, calib_txt, monkeypatch):
    """Root passes every permission check, so the refusal is injected where packaging copies a file."""
    real = shutil.copy2

    def copy2(a, b, **kw):
        if Path(b).parent.name.startswith(".out."):
            raise PermissionError(13, "Permission denied", str(b))
        return real(a, b, **kw)

    monkeypatch.setattr(shutil, "copy2", copy2)
    out = tmp_path / "out"
    r = run(*build_args(src, out, tmp_path / "work", calib_txt))
    one_error(r, r"writing the artifact: permission denied")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


# ---- cached stages and source hashes ----------------------------------------------------------------------------


def _weights(out: Path) -> dict:
    return {k: v["sha256"] for k, v in json.loads((out / "qconv.json").read_text())["files"].items()}


def test_a_tampered_stage_folder_is_recomputed(src, tmp_path, calib_txt):
    work = tmp_path / "work"
    assert run(*build_args(src, tmp_path / "A", work, calib_txt)).exit_code == 0
    (stage,) = work.glob("quantization-*")
    shard = stage / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100:] = bytes(100)  # same size, other weights
    shard.write_bytes(bytes(data))
    r = run(*build_args(src, tmp_path / "B", work, calib_txt))
    assert r.exit_code == 0, r.output
    assert _weights(tmp_path / "B") == _weights(tmp_path / "A")


def test_source_edited_with_same_name_size_and_mtime_is_rehashed(src, tmp_path, calib_txt):
    work = tmp_path / "work"
    assert run(*build_args(src, tmp_path / "A", work, calib_txt)).exit_code == 0
    cfg = src / "generation_config.json"
    st = cfg.stat()
    text = cfg.read_text()
    edited = text.replace('"bos_token_id": 0', '"bos_token_id": 1')
    assert edited != text and len(edited) == len(text)
    cfg.write_text(edited)
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert run(*build_args(src, tmp_path / "B", work, calib_txt)).exit_code == 0
    m = json.loads((tmp_path / "B" / "qconv.json").read_text())
    assert m["source"]["files"]["generation_config.json"]["sha256"] == hashlib.sha256(cfg.read_bytes()).hexdigest()


# ---- kill -9 at random points -----------------------------------------------------------------------------------

# (log line, longest delay after it): seed i kills in phase i -- calibration, GPTQ, saving the stage folder,
# packaging into the temp folder beside --out, and the finalize + atomic swap.
POINTS = [
    ("stage calibration", 1.0),
    ("stage quantization", 3.0),
    ("Writing model shards", 0.2),
    ("Dispatching model", 0.2),
    ("quality report skipped", 0.05),
]


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama, calib_txt, tmp_path_factory) -> Path:
    """The tiny model built without interruption, as the killed builds run: a process with one thread (GPTQ's sums
    follow it), from another copy of the source (the artifact's files do not depend on where it lies). Read only."""
    root = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(tiny_llama, root / "src")
    ref = root / "ref"
    done = subprocess.run(
        _cli(*build_args(root / "src", ref, root / "work", calib_txt)), env=_env(), capture_output=True
    )
    assert done.returncode == 0, done.stderr
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_kill9_at_a_random_point_then_rerun_is_bit_identical(seed, src, tmp_path, calib_txt, uninterrupted):
    """A build killed at a random moment (after a random log line, plus a random delay), rerun with --force into
    the same --out and work dir, ends with the same file table as an uninterrupted build in the same environment
    and no stray folders.
    Odd seeds replace an earlier artifact, so the kill can also land in the atomic swap."""
    rng = random.Random(seed)
    ref = uninterrupted
    out, work = tmp_path / "out", tmp_path / "work"
    if seed % 2:
        shutil.copytree(ref, out)
    point, longest = POINTS[seed % len(POINTS)]
    delay = rng.uniform(0, longest)
    p = subprocess.Popen(
        _cli(*build_args(src, out, work, calib_txt, "--force")),
        env=_env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    for line in p.stderr:
        if point in line:
            break
    time.sleep(delay)
    p.kill()
    p.wait()
    p.stderr.close()
    r = subprocess.run(
        _cli(*build_args(src, out, work, calib_txt, "--force")), env=_env(), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert (
        json.loads((out / "qconv.json").read_text())["files"] == json.loads((ref / "qconv.json").read_text())["files"]
    )
    assert file_table(out, exclude=("qconv.json",)) == file_table(ref, exclude=("qconv.json",))
    assert not list(tmp_path.glob(".out.*")) and strays(work) == [] and strays(out) == []


# ---- hostile inputs (issue 34) -------------------------------------------------------------------------------------


def alias_bomb(levels: int = 9) -> str:
    """~500 bytes of YAML whose list-valued key expands to 9**levels items once anything walks it."""
    lines = ['extends: "3090"', "quality:", "  x0: &l0 [a, a, a, a, a, a, a, a, a]"]
    lines += [f"  x{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines + ["selection:", f"  candidates: *l{levels - 1}", ""])


def test_a_yaml_alias_bomb_is_refused_in_bounded_memory(tmp_path, src, calib_txt):
    """Run in a child process under a 3 GiB address-space limit: before the fix it died with MemoryError."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 700
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
        "from qconv.cli import main; sys.exit(main())"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            *cli_helpers.build_args(bomb, src, tmp_path / "out"),
            "--dataset",
            str(calib_txt),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 2 and "YAML alias (*l0)" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr) < 2000 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "case",
    ["config_array", "config_text_config", "extends_a_list", "recipe_binary", "recipe_control_char", "extends_proc"],
)
def test_damaged_config_or_recipe_is_one_error_naming_the_file(case, src, tmp_path, calib_txt):
    recipe = "3090"
    if case == "config_array":
        (src / "config.json").write_text("[1, 2, 3]")
    elif case == "config_text_config":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "text_config": "big"}))
    elif case == "extends_a_list":
        (tmp_path / "base.yaml").write_text("- a\n- b\n")
        (tmp_path / "child.yaml").write_text("extends: base.yaml\n")
        recipe = tmp_path / "child.yaml"
    elif case == "recipe_control_char":  # a yaml.reader.ReaderError traceback before
        recipe = tmp_path / "r.yaml"
        recipe.write_text("extends: '3090'\nname: a\x01b\n")
    elif case == "extends_proc":
        recipe = tmp_path / "r.yaml"
        recipe.write_text("extends: /proc/self/environ\n")
    else:
        recipe = tmp_path / "r.yaml"
        recipe.write_bytes(b"\xff\xfe\x00garbage")
    pattern = {
        "config_array": r"config\.json is not a JSON object",
        "config_text_config": "text_config is not a",
        "extends_a_list": r"base\.yaml, which is not a recipe",
        "recipe_binary": "not a text file",
        "recipe_control_char": r"control character \('\\x01'\)",
        "extends_proc": r"control character .*/proc/self/environ",
    }[case]
    out, work = tmp_path / "out", tmp_path / "work"
    for extra in (["--dry-run"], []):
        r = run(
            *cli_helpers.build_args(recipe, src, out, "--work-dir", work, "--dataset", calib_txt, *FAST_CAL, *extra)
        )
        one_error(r, pattern)
        assert not out.exists() and stage_results(work) == []


def test_dry_run_refuses_the_out_the_build_refuses(src, tmp_path, calib_txt):
    """`--dry-run` says what the build will say: the same check of --out, the same error."""
    work = tmp_path / "work"
    said = []
    for extra in (["--dry-run"], []):
        r = run(*build_args(src, src, work, calib_txt, "--force", *extra))
        one_error(r, r"could destroy")
        said.append([ln for ln in r.output.splitlines() if ln.startswith("error:")])
    assert said[0] == said[1]


def rewrite_header(shard: Path, edit) -> None:
    """Edit a safetensors file's JSON header in place, keeping its data bytes."""
    import struct

    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _grow_first(h: dict) -> None:
    t = next(v for k, v in h.items() if k != "__metadata__")
    t["shape"] = [t["shape"][0] * 100000, *t["shape"][1:]]


@pytest.mark.parametrize("case", ["shape_vs_bytes", "truncated", "bad_dtype"])
def test_a_corrupt_safetensors_header_is_refused_by_dry_run_and_build(case, src, tmp_path, calib_txt):
    """The one header reader checks each tensor's bytes against its dtype and shape: the dry run no longer prints a
    size estimate of a million GB, and both name the file."""
    shard = sorted(src.glob("*.safetensors"))[0]
    if case == "shape_vs_bytes":
        rewrite_header(shard, _grow_first)
    elif case == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        rewrite_header(shard, lambda h: next(v for k, v in h.items() if k != "__metadata__").update(dtype="Q9"))
    out, work = tmp_path / "out", tmp_path / "work"
    for extra in (["--dry-run"], []):
        r = run(*build_args(src, out, work, calib_txt, *extra))
        one_error(r, r"corrupt or truncated safetensors file")
        assert str(shard) in r.output and "GB" not in r.output and not out.exists()


@pytest.mark.parametrize("bpw", ["nan", "inf", "-inf", "1e400", "0", "33"])
def test_a_bpw_that_is_not_a_number_of_bits_is_one_error(bpw, src, tmp_path, calib_txt):
    """`--bpw nan` / `inf`: a ValueError / OverflowError traceback from the budget arithmetic."""
    out, work = tmp_path / "out", tmp_path / "work"
    for extra in (["--dry-run"], []):
        r = run(*build_args(src, out, work, calib_txt, "--bpw", bpw, *extra))
        one_error(r, r"bits-per-weight target .* is not a number of bits a weight can take")
        assert not out.exists() and stage_results(work) == []


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_out_where_no_folder_can_be_made_is_one_error(where, src, tmp_path, calib_txt):
    """`-o f/sub` with `f` a file, or `-o /proc/x`: a FileExistsError / FileNotFoundError traceback from the
    writability probe, and `--dry-run` passed both with exit 0."""
    (tmp_path / "f").write_text("mine")
    out = tmp_path / "f" / "sub" if where == "under_a_file" else Path("/proc/qconv-out")
    pattern = r"is a file, not a folder" if where == "under_a_file" else r"kernel's proc file system"
    for extra in (["--dry-run"], []):
        r = run(*build_args(src, out, tmp_path / "work", calib_txt, *extra))
        one_error(r, pattern)
    assert (tmp_path / "f").read_text() == "mine"
