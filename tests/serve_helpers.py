"""Running servers from tests and benchmarks: our native server in a thread of this process (`BackgroundServer`),
`qconv serve` as a child process (`ServerProcess`, ours or vLLM), and a small load generator for OpenAI-compatible
servers (streaming chat clients at a fixed concurrency)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qconv.bench import launch


@dataclass
class ClientResult:
    prompt: str
    text: str
    completion_tokens: int
    ttft: float  # seconds to the first content chunk
    elapsed: float
    finish_reason: str | None


@dataclass
class LoadResult:
    results: list[ClientResult]
    wall: float

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


def stream_one(
    client, model: str, prompt: str, max_tokens: int, chat: bool = True, timeout: float = 300.0
) -> ClientResult:
    """One greedy streaming request (chat, or a raw completion of `prompt`), timed from send to last chunk."""
    t0 = time.monotonic()
    parts, ttft, usage, finish = [], None, None, None
    kw = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        timeout=timeout,
        stream_options={"include_usage": True},
    )
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = client.completions.create(prompt=prompt, **kw)
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            c = chunk.choices[0]
            text = c.delta.content if chat else c.text
            if text:
                ttft = ttft if ttft is not None else time.monotonic() - t0
                parts.append(text)
            finish = c.finish_reason or finish
    elapsed = time.monotonic() - t0
    return ClientResult(
        prompt,
        "".join(parts),
        usage.completion_tokens if usage else 0,
        ttft if ttft is not None else elapsed,
        elapsed,
        finish,
    )


def run_load(
    client, model: str, prompts: list[str], concurrency: int, max_tokens: int, chat: bool = True
) -> LoadResult:
    """Every prompt once, `concurrency` in flight at a time; results in prompt order."""
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(lambda p: stream_one(client, model, p, max_tokens, chat), prompts))
    return LoadResult(results, time.monotonic() - t0)


class ServerProcess(launch.ServerProcess):
    """`qconv serve ...` as a child process on loopback, as `qconv bench` starts it (qconv.bench.launch), from the
    repo root with its output on our stderr."""

    def __init__(self, args: list[str], port: int, env: dict | None = None, health_timeout: float = 300.0):
        super().__init__(args, port, env=env, health_timeout=health_timeout, cwd=Path(__file__).resolve().parents[1])


free_port = launch.free_port


class BackgroundServer:
    """uvicorn in a thread of this process, on a free loopback port; `with` stops it and its scheduler."""

    def __init__(self, app, sched, host: str = "127.0.0.1", port: int | None = None, limits=None):
        """The server as `qconv serve` runs it (its uvicorn config and connection limits), quieter."""
        import uvicorn

        from qconv.serve.limits import ConnectionLimits, uvicorn_config

        self.sched, self.host, self.port = sched, host, port or free_port()
        config = uvicorn_config(app, host, self.port, limits or ConnectionLimits(), log_level="warning")
        config.timeout_graceful_shutdown = 2
        self.server = uvicorn.Server(config)
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
