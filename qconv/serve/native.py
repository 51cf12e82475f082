"""Serve a model with qconv's own engine: load it, size the cache from the serving profile, run the scheduler
thread and uvicorn."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType

from qconv.artifact import Artifact
from qconv.engine.config import as_spec
from qconv.engine.spec import SpecConfig
from qconv.errors import QconvError
from qconv.models.spec import ModelSpec
from qconv.recipes.sections import Speculative
from qconv.serve.limits import ConnectionLimits

DEFAULT_NATIVE_CONTEXT = 4096  # the native cache is allocated up front for every slot: keep the default modest
DEFAULT_MAX_TOKENS = 2048  # a chat request without max_tokens, when the profile names no `max_tokens` of its own
log = logging.getLogger(__name__)


@dataclass
class NativeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    max_model_len: int | None = None  # None: the profile's context, capped at DEFAULT_NATIVE_CONTEXT
    profile: str | None = None
    served_model_name: str | None = None
    spec_tokens: int | None = None  # draft tokens per step (0: off); None: the artifact's speculative config
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    device: str = "auto"  # cpu | cuda | auto (cuda when torch sees one)
    compute_dtype: str = "auto"  # float32 | bfloat16 | auto (the engine's: engine_dtype on a CPU, bf16 on a GPU)


@dataclass
class NativePlan:
    context_len: int
    kv_scheme: str = "bf16"
    spec: SpecConfig = SpecConfig("none")
    max_tokens: int = DEFAULT_MAX_TOKENS  # completion cap of a chat request that sends none


def native_plan(path: Path | ModelSpec, opts: NativeOptions, art: Artifact | None | EllipsisType = ...) -> NativePlan:
    """Context, KV scheme and speculation from the artifact's manifest when it has one (`art`: the
    artifact the caller opened already, None for a plain folder; `...`: open it here). `path`: the model folder or
    its ModelSpec."""
    spec = as_spec(path)
    path = spec.folder
    max_pos = spec.max_positions or DEFAULT_NATIVE_CONTEXT
    plan = NativePlan(min(max_pos, DEFAULT_NATIVE_CONTEXT))
    if art is ...:
        art = Artifact.find(path)
    if art is not None and art.profiles:
        _, p = art.profile(opts.profile)
        plan.context_len = min(p.context_length, max_pos, DEFAULT_NATIVE_CONTEXT)
        plan.kv_scheme = p.kv_cache
        plan.max_tokens = p.max_tokens or DEFAULT_MAX_TOKENS
    elif opts.profile:
        raise QconvError(f"{path} has no serving profiles", where="--profile", fix="drop --profile for a plain model")
    spec = art.speculative if art is not None else Speculative("lookup") if opts.spec_tokens else None
    plan.spec = SpecConfig.from_manifest(spec, opts.spec_tokens)
    if opts.max_model_len:
        plan.context_len = min(opts.max_model_len, max_pos)
    return plan


def engine_device(requested: str) -> str:
    """`auto`: cuda when torch sees a CUDA device, else cpu; `cuda` without one is an error."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise QconvError("no CUDA device is visible to torch", where="--device", fix="--device cpu (or auto)")
    return requested


def build_native(path: str | Path | ModelSpec, opts: NativeOptions, art: Artifact | None | EllipsisType = ...):
    """(FastAPI app, started Scheduler) for the model at `path` (a folder or its ModelSpec), loaded as `qconv
    generate` loads it (bf16 with the CPU int kernels for an artifact where torch has them)."""
    from qconv.engine.loader import describe_engine, load_for_engine, load_model, load_tokenizer
    from qconv.serve.scheduler import Scheduler
    from qconv.serve.server import ServerConfig, create_app

    spec = as_spec(path)
    path = spec.folder
    plan = native_plan(spec, opts, art)
    tok = load_tokenizer(path)
    device = engine_device(opts.device)
    if device == "cpu":
        model = load_for_engine(spec, dtype=opts.compute_dtype)
    else:  # the CPU int kernels do not run there: dense weights on the device, bf16 unless asked otherwise
        from qconv.compute import resolve

        model = load_model(spec, dtype=resolve(opts.compute_dtype, device), pack=False, int_kernels=False).to(device)
    log.warning(
        "native engine on %s: %s, %d slots x %d tokens, KV %s",
        device,
        describe_engine(model),
        opts.max_batch,
        plan.context_len,
        plan.kv_scheme,
    )
    plan.spec = plan.spec.for_model(model)
    sched = Scheduler(
        model,
        tok,
        max_batch=opts.max_batch,
        max_len=plan.context_len,
        max_queue=opts.max_queue,
        kv_scheme=plan.kv_scheme,
        spec=plan.spec,
    ).start()
    cfg = ServerConfig(
        opts.served_model_name or path.name,
        plan.context_len,
        opts.api_key,
        max_tokens=min(plan.max_tokens, plan.context_len),
        host=opts.host,
    )
    return create_app(sched, cfg), sched


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse a non-loopback bind without an API key: anyone who can reach the address would use the model, and the
    Host check that keeps web pages out (DNS rebinding) can only run on a loopback bind, where every legitimate Host
    header is known."""
    from qconv.serve.limits import is_loopback

    if not is_loopback(host) and not api_key:
        raise QconvError(
            f"serving on {host} without an API key: anyone who can reach this address could use the model",
            where="--host",
            fix="set QCONV_API_KEY (clients then send 'Authorization: Bearer <key>'), or bind 127.0.0.1",
        )


SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")  # pyproject's `serve` extra, by import name


def require_serve_extra() -> None:
    """qconv's own server needs the `serve` extra; say how to get it, once, instead of an import traceback."""
    import importlib.util

    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise QconvError(
            f"qconv's own server needs {', '.join(missing)}, which this environment lacks",
            where="qconv serve",
            fix="pip install 'qconv[serve]' (in a checkout: bash scripts/setup.sh gguf,eval,serve)",
        )


def run_native(path: str | Path | ModelSpec, opts: NativeOptions, art: Artifact | None | EllipsisType = ...) -> None:
    require_serve_extra()
    import uvicorn

    from qconv.serve.limits import uvicorn_config

    check_bind(opts.host, opts.api_key)
    app, sched = build_native(path, opts, art)
    try:
        uvicorn.Server(uvicorn_config(app, opts.host, opts.port, opts.limits)).run()
    finally:
        sched.stop()
