"""Serve a model with qconv's own engine: load it, size the cache from the serving profile, run the scheduler
thread and uvicorn. `BackgroundServer` runs the same thing inside a process (tests, benchmarks)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qconv.artifact import Artifact
from qconv.errors import QconvError

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
    dtype: str = "float32"
    spec_tokens: int | None = None  # prompt-lookup drafts per step; None: the artifact's speculative config
    datastore: tuple[str, ...] = ()  # text files / folders greedy rows also draft from (runtime.datastore)


@dataclass
class NativePlan:
    context_len: int
    kv_scheme: str = "none"
    spec_tokens: int = 0
    lookup_ngram: tuple[int, int] = (4, 2)
    max_tokens: int = DEFAULT_MAX_TOKENS  # completion cap of a chat request that sends none


def native_plan(path: Path, opts: NativeOptions) -> NativePlan:
    """Context, runtime KV scheme and prompt-lookup speculation from the artifact's manifest when it has one.
    The batched scheduler drafts by prompt lookup only: the MTP part of `hybrid` needs the single-stream engine."""
    cfg = json.loads((path / "config.json").read_text())
    max_pos = int((cfg.get("text_config") or cfg).get("max_position_embeddings") or DEFAULT_NATIVE_CONTEXT)
    plan = NativePlan(min(max_pos, DEFAULT_NATIVE_CONTEXT))
    art = Artifact.find(path)
    if art is not None and art.profiles:
        _, p = art.profile(opts.profile)
        plan.context_len = min(p.context_length, max_pos, DEFAULT_NATIVE_CONTEXT)
        plan.kv_scheme = "none" if p.kv_cache == "bf16" else p.kv_cache
        plan.max_tokens = p.max_tokens or DEFAULT_MAX_TOKENS
    elif opts.profile:
        raise QconvError(f"{path} has no serving profiles", where="--profile", fix="drop --profile for a plain model")
    spec = art.speculative if art is not None else None
    if spec is not None and spec.method in ("lookup", "hybrid"):
        plan.spec_tokens = spec.num_speculative_tokens
        plan.lookup_ngram = (spec.lookup.ngram_max, spec.lookup.ngram_min)
    if opts.spec_tokens is not None:
        plan.spec_tokens = opts.spec_tokens
    if opts.max_model_len:
        plan.context_len = min(opts.max_model_len, max_pos)
    return plan


def build_native(path: str | Path, opts: NativeOptions):
    """(FastAPI app, started Scheduler) for the model at `path`."""
    import torch

    from qconv.runtime.loader import load_model, load_tokenizer
    from qconv.serve.scheduler import Scheduler

    try:
        from qconv.serve.server import ServerConfig, create_app
    except ImportError as e:
        raise QconvError(f"the native server needs {e.name}", fix="pip install 'qconv[serve]'") from e

    path = Path(path)
    if not (path / "config.json").is_file():
        raise QconvError(f"no config.json in {path}", where=str(path), fix="pass a model or artifact folder")
    plan = native_plan(path, opts)
    tok = load_tokenizer(path)
    store = None
    if opts.datastore:
        if not plan.spec_tokens:
            raise QconvError("--datastore drafts for speculation, which is off", where="--datastore",
                             fix="add --spec-tokens N (N > 0), or serve an artifact whose recipe speculates")
        from qconv.runtime.datastore import load_datastore

        store = load_datastore(list(opts.datastore), tok)
    model = load_model(path, dtype=getattr(torch, opts.dtype), max_batch=opts.max_batch)
    sched = Scheduler(model, tok, max_batch=opts.max_batch, max_len=plan.context_len,
                      max_queue=opts.max_queue, kv_scheme=plan.kv_scheme, spec_tokens=plan.spec_tokens,
                      lookup_ngram=plan.lookup_ngram, datastore=store).start()
    cfg = ServerConfig(opts.served_model_name or path.name, plan.context_len, opts.api_key,
                       max_tokens=min(plan.max_tokens, plan.context_len), host=opts.host)
    return create_app(sched, cfg), sched


def bind_warnings(host: str, api_key: str | None) -> list[str]:
    """What to tell the operator about exposure before serving."""
    from qconv.serve.server import is_loopback

    if not is_loopback(host) and not api_key:
        return [f"serving on {host} without an API key: anyone who can reach this address can use the model "
                f"(set QCONV_API_KEY, or bind 127.0.0.1)"]
    return []


def run_native(path: str | Path, opts: NativeOptions) -> None:
    import uvicorn

    for w in bind_warnings(opts.host, opts.api_key):
        log.warning("%s", w)
    app, sched = build_native(path, opts)
    try:
        uvicorn.run(app, host=opts.host, port=opts.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        sched.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn in a thread of this process, on a free loopback port; `with` stops it and its scheduler."""

    def __init__(self, app, sched, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.sched, self.host, self.port = sched, host, port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sched.stop()
