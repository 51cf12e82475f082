"""The vLLM backend: turn an artifact's (or a recipe's) serving profile into a `vllm serve` command line, check
that the installed vLLM can run it, then start it, wait for /health and forward signals.

vLLM reads our compressed-tensors artifacts; what stock vLLM lacks for them (qconv.json `requires`) comes from the
qconv-vllm plugin installed in the same environment (`qconv runtime install`). qconv adds the flags: the profile's
context, KV dtype, speculation and memory settings, which otherwise live only in `qconv.json` / the recipe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType

from qconv.artifact import Artifact, choose_profile
from qconv.errors import QconvError
from qconv.manifest import MANIFEST, Requirement
from qconv.models.spec import ModelSpec
from qconv.recipes.recipe import load_recipe
from qconv.recipes.sections import Profile, Speculative
from qconv.serve.vllm_compute import cpu_kernel_env, user_dtype, vllm_dtype
from qconv_vllm.limits import ConnectionLimits

KV_TO_VLLM = {"bf16": "auto", "fp8_e4m3": "fp8_e4m3"}  # kvarn_* pass through under their own name


@dataclass
class ServeSource:
    """What the command is built from: a model folder plus the profiles/speculation that ship with it."""

    model_dir: Path
    name: str
    spec: ModelSpec  # what the model is (its family says which vLLM flags it needs)
    profiles: dict[str, Profile]
    default_profile: str
    speculative: Speculative | None
    requires: list[Requirement] = field(default_factory=list)

    @property
    def config(self) -> dict:
        return self.spec.config

    @property
    def model_type(self) -> str:
        return self.spec.model_type

    @property
    def architecture(self) -> str:
        return (self.spec.architectures or ("",))[0]

    @property
    def hybrid(self) -> bool:
        """Gated-DeltaNet (mamba-style state) mixed with attention: --mamba-ssm-cache-dtype, and vLLM's prefix
        caching off (wrong reuse of recurrent state)."""
        return self.spec.hybrid

    @property
    def max_position_embeddings(self) -> int | None:
        return self.spec.max_positions or None

    @property
    def has_mtp(self) -> bool:
        return self.spec.mtp_layers > 0


def load_source(
    path: str | Path,
    recipe: str | None = None,
    art: Artifact | None | EllipsisType = ...,
    spec: ModelSpec | None = None,
) -> ServeSource:
    """An artifact (profiles from `qconv.json`) or a plain config folder with `--recipe` (no weights needed).
    `art`: the artifact the caller opened already (None: a plain folder; `...`: open it here); `spec`: the model's
    ModelSpec the caller read already."""
    path = Path(path)
    if spec is None:
        if not (path / "config.json").is_file():
            raise QconvError(
                f"no config.json in {path}",
                where=str(path),
                fix="pass an artifact folder (qconv build --out) or an HF config folder with --recipe",
            )
        spec = ModelSpec.read(path)
    if recipe is None and art is ...:
        art = Artifact.find(path)
    if recipe is None and art is not None:
        return ServeSource(path, path.name, spec, art.profiles, art.default_profile, art.speculative, art.requires)
    if recipe is None:
        raise QconvError(
            f"{path} has no {MANIFEST}, so it carries no serving profiles",
            where=str(path),
            fix="pass --recipe NAME (e.g. --recipe 3090) to take the profiles from a recipe",
        )
    r = load_recipe(recipe)
    return ServeSource(path, path.name, spec, r.profiles, r.default_profile, r.speculative, [])


def pick_profile(src: ServeSource, profile: str | None) -> tuple[str, Profile]:
    return choose_profile(src.profiles, profile or src.default_profile, src.name)


def kvarn_block_size(kv: str) -> int:
    """KVarN quantizes KV in tiles of its group size; the vLLM block must be one tile."""
    return int(kv.rsplit("_g", 1)[1])


def speculative_config(src: ServeSource, platform: str | None = None, tokens: int | None = None) -> dict | None:
    """vLLM's --speculative-config. vLLM runs one method per server: `hybrid` (MTP + prompt lookup in qconv's
    runtime) becomes MTP when the checkpoint has an MTP head (vLLM's MTP proposer cannot be stretched), else n-gram
    lookup, stretched to the lookup block after `after_saturated` fully accepted steps by the plugin's custom_class
    proposer (qconv_vllm/stretch.py); `dflash` passes its drafter model through. vLLM's CPU backend cannot run
    speculation on hybrid (Gated-DeltaNet) models, so none is set there."""
    spec = src.speculative
    method = spec.method if spec is not None else "none"
    n = (spec.num_speculative_tokens if spec is not None else 0) if tokens is None else tokens
    if method == "none" or n <= 0:
        return None
    if platform == "cpu" and src.hybrid:
        return None
    if method == "dflash":
        return {"method": "dflash", "model": spec.drafter, "num_speculative_tokens": n}  # validated: has a drafter
    if method in ("mtp", "hybrid") and src.has_mtp:
        return {"method": "mtp", "num_speculative_tokens": n}
    if method == "mtp":
        raise QconvError(
            f"speculative method mtp, but {src.name} has no MTP head (mtp_num_hidden_layers = 0)",
            fix="use a recipe with speculative.method lookup or none",
        )
    lk = spec.lookup
    if method == "hybrid" and lk.after_saturated and lk.max_block > n:  # the stretch: the plugin's proposer
        name = f"StretchedLookup_k{n}_s{lk.after_saturated}_n{lk.ngram_min}_{lk.ngram_max}"
        return {"method": "custom_class", "model": f"qconv_vllm.stretch.{name}", "num_speculative_tokens": lk.max_block}
    return {
        "method": "ngram",
        "num_speculative_tokens": n,
        "prompt_lookup_max": lk.ngram_max,
        "prompt_lookup_min": lk.ngram_min,
    }


W4A8_ENV = "QCONV_VLLM_W4A8"  # the plugin's: which Marlin linears take int8 input (a regex on the module name)


def profile_env(src: ServeSource, profile: str | None, platform: str | None) -> tuple[dict[str, str], str | None]:
    """Environment a profile needs in vLLM, and a line to tell the user when part of it cannot apply. W4A8: Marlin's
    int8 input path (VLLM_MARLIN_INPUT_DTYPE=int8, CUDA sm80+) on the profile's roles only (the plugin reads
    QCONV_VLLM_W4A8; vLLM's own switch covers every Marlin linear)."""
    name, p = pick_profile(src, profile)
    if not p.w4a8:
        return {}, None
    if platform == "cpu":
        return {}, (
            f"profile {name}: W4A8 ({', '.join(p.w4a8)}) runs on Marlin, which is CUDA-only; vLLM's CPU "
            "backend serves these linears W4A16"
        )
    modules = src.spec.family.vllm_role_modules  # a recipe role's linears as vLLM names them (fused where it fuses)
    pattern = "|".join(f"(?:{modules[r]})" for r in p.w4a8 if r in modules)
    return {"VLLM_MARLIN_INPUT_DTYPE": "int8", W4A8_ENV: pattern}, None


def numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


def check_tensor_parallel(src: ServeSource, tp: int) -> None:
    """vLLM shards attention heads evenly over the ranks, and runs input rotations on one rank only: a size it cannot
    serve stops its load after minutes of start-up; say it before."""
    if tp > 1 and src.spec.transform_config:
        raise QconvError(
            f"{src.name} has input rotations (transform_config), which vLLM 0.32 runs at tensor-parallel size 1 only "
            "('Online transforms with tensor parallelism is not supported')",
            where="--tensor-parallel-size",
            fix="serve it with --tensor-parallel-size 1, or build with quantizer.rotation: null",
        )
    heads = src.spec.heads
    if tp > 1 and heads and heads % tp:
        sizes = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise QconvError(
            f"{src.name} has {heads} attention heads, which --tensor-parallel-size {tp} does not divide (vLLM "
            "shards heads evenly over the ranks)",
            where="--tensor-parallel-size",
            fix=f"use a size that divides {heads}: {sizes}",
        )


def cpu_rank_binding(tp: int, platform: str | None) -> dict[str, str]:
    """Tensor parallelism on vLLM's CPU backend: each rank's threads are bound to cores. vLLM's own binding ('auto')
    gives each rank a NUMA node and stops where the host has fewer nodes than ranks; there, this process's CPUs are
    split evenly among the ranks (VLLM_CPU_OMP_THREADS_BIND). A binding the user set is kept."""
    if platform != "cpu" or tp <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    if numa_nodes() >= tp:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise QconvError(
            f"--tensor-parallel-size {tp} on vLLM's CPU backend needs a core per rank; this process may use "
            f"{len(cpus)}",
            where="--tensor-parallel-size",
            fix=f"use at most {len(cpus)}, or give the process more CPUs",
        )
    per = len(cpus) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpus[r * per : (r + 1) * per])) for r in range(tp))}


def launch_env(
    src: ServeSource,
    profile: str | None,
    platform: str | None,
    tp: int,
    limits: ConnectionLimits | None = None,
    dtype: str | None = None,
) -> tuple[dict[str, str], str | None]:
    """Everything qconv sets in vLLM's environment: the profile's (profile_env, with its note), the CPU ranks'
    core binding (cpu_rank_binding), the kernels vLLM's DTYPE needs (cpu_kernel_env) and, launched through the
    plugin's front door, the connection limits."""
    env, note = profile_env(src, profile, platform)
    env |= cpu_rank_binding(tp, platform) | cpu_kernel_env(dtype, platform)
    return env | (limits.env() if limits else {}), note


@dataclass
class LaunchOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None  # overrides the profile's
    python: str = sys.executable  # the interpreter that has vLLM installed (may be another venv)
    extra_args: list[str] = field(default_factory=list)
    platform: str | None = None  # "cuda" | "cpu" when known (a runtime record, the probe): shapes speculation
    spec_tokens: int | None = None  # overrides the artifact's num_speculative_tokens; 0 turns speculation off
    compute_dtype: str = "auto"  # --compute-dtype: what vLLM computes in (vllm_dtype)
    # vLLM's API server through the plugin's launcher (qconv_vllm.frontdoor: qconv's connection limits, a text-only
    # door); only where the plugin is installed and loaded
    frontdoor: bool = False


API_SERVER, FRONTDOOR = "vllm.entrypoints.openai.api_server", "qconv_vllm.frontdoor"
TEXT_ONLY = "qconv_vllm.frontdoor.TextOnly"


def added_dtype(src: ServeSource, opts: LaunchOptions) -> str | None:
    """The --dtype qconv puts on vLLM's command line: none where the user's arguments after `--` name one."""
    if any(a == "--dtype" or a.startswith("--dtype=") for a in opts.extra_args):
        return None
    return vllm_dtype(opts.compute_dtype, opts.platform, src.hybrid)


def served_dtype(src: ServeSource, opts: LaunchOptions) -> str | None:
    """The dtype vLLM computes in: the user's --dtype after `--`, else qconv's (added_dtype); None: the model's."""
    return user_dtype(opts.extra_args) or added_dtype(src, opts)


def build_command(src: ServeSource, profile: str | None, opts: LaunchOptions) -> list[str]:
    """The argv that serves `src` under `profile` (pure: no vLLM needed)."""
    _, p = pick_profile(src, profile)  # typed and bounded when read (Profile.validate): no value becomes a flag
    check_tensor_parallel(src, opts.tensor_parallel_size)
    kv = p.kv_cache
    argv = [
        opts.python,
        "-m",
        FRONTDOOR if opts.frontdoor else API_SERVER,
        "--model",
        str(src.model_dir),
        "--served-model-name",
        src.name,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        "--max-model-len",
        str(min(p.context_length, src.max_position_embeddings or 1 << 62)),
        "--kv-cache-dtype",
        KV_TO_VLLM.get(kv, kv),
    ]
    if kv.startswith("kvarn_"):  # the plugin's backend: one block per tile; its fp16 first tile is per sequence
        argv += ["--block-size", str(kvarn_block_size(kv))] + ([] if src.hybrid else ["--no-enable-prefix-caching"])
    argv += ["--max-num-seqs", str(opts.max_num_seqs or p.max_num_seqs)]
    argv += ["--gpu-memory-utilization", str(p.gpu_memory_utilization)]
    if src.hybrid:
        argv += ["--mamba-ssm-cache-dtype", p.mamba_ssm_cache_dtype, "--no-enable-prefix-caching"]
    vision = src.spec.multimodal
    if vision and (p.language_model_only or opts.platform == "cpu"):
        # vLLM's CPU runtime has no image stack (runtimes.py installs a text-only torchvision stand-in): loaded text
        # only, an image is refused at the API with a 400 instead of failing inside the model
        argv += ["--language-model-only"]
        vision = False
    if opts.frontdoor and not vision:  # refused by qconv's door, in qconv's words, before vLLM parses it
        argv += ["--middleware", TEXT_ONLY]
    if (spec := speculative_config(src, opts.platform, opts.spec_tokens)) is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if opts.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(opts.tensor_parallel_size)]
    if (dtype := added_dtype(src, opts)) is not None:
        argv += ["--dtype", dtype]
    return argv + list(opts.extra_args)


def vllm_env(api_key: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The API key goes to vLLM through its environment (VLLM_API_KEY), not argv, which `ps` shows to everyone.
    vLLM's CPU backend also needs a KV budget in GiB (VLLM_CPU_KVCACHE_SPACE); ignored on GPUs."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return {**env, **(extra or {})}


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise QconvError(
                f"vLLM exited with code {proc.returncode} before it was healthy",
                fix="read its log above; try another --profile or --backend native",
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise QconvError(f"vLLM did not become healthy within {timeout:.0f} s ({url})", fix="check its log")


def _stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """vLLM forks an engine core and workers: signal its whole process group, escalate to SIGKILL, and reap it."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a leader that already exited
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_vllm(
    argv: list[str],
    host: str,
    port: int,
    *,
    api_key: str | None = None,
    health_timeout: float = 1800.0,
    env: dict[str, str] | None = None,
) -> int:
    """Start vLLM in its own session, wait for /health, then stay in the foreground forwarding SIGINT/SIGTERM to its
    process group; its exit code. Whatever way this returns, no vLLM process is left running."""
    proc = subprocess.Popen(argv, env=vllm_env(api_key, env), start_new_session=True)
    stopping = []

    def forward(signum, _frame):
        stopping.append(signum)
        if proc.poll() is None:
            os.killpg(proc.pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            wait_healthy(
                proc, f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/health", health_timeout
            )
        except QconvError:
            if stopping:  # stopped by the user while loading: not a failure of vLLM's
                return proc.wait()
            raise
        print(f"vLLM is serving on http://{host}:{port}/v1", file=sys.stderr, flush=True)
        return proc.wait()
    finally:
        _stop_group(proc)
        for s, h in old.items():
            signal.signal(s, h)
