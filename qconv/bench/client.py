"""The load generator: streaming chat requests to an OpenAI-compatible server at a fixed concurrency, each request
timed as `vllm bench serve` times it (TTFT at the first token chunk, ITL between chunks, latency to the last chunk,
output tokens from the server's usage), and the server's Prometheus text read before and after."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from qconv.errors import QconvError


@dataclass
class RequestResult:
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first chunk that carries text
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks after it
    latency: float = 0.0  # seconds from send to the last chunk with a choice
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Endpoint:
    base: str  # http://host:port (no /v1)
    model: str = ""
    api_key: str | None = None
    max_model_len: int = 0

    def _request(self, path: str, body: dict | None = None, timeout: float = 10.0):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers=headers)
        return urllib.request.urlopen(req, timeout=timeout)

    def get_text(self, path: str, timeout: float = 10.0) -> str:
        with self._request(path, timeout=timeout) as r:
            return r.read().decode()

    def connect(self, timeout: float = 10.0) -> Endpoint:
        """Ask /v1/models for the served model's id and context; one clear error if nothing usable answers."""
        try:
            models = json.loads(self.get_text("/v1/models", timeout))["data"]
        except urllib.error.HTTPError as e:
            fix = "pass the server's key in QCONV_API_KEY" if e.code == 401 else "point --url at the server's root"
            raise QconvError(f"{self.base}/v1/models answered HTTP {e.code}", where="--url", fix=fix) from e
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise QconvError(
                f"no OpenAI-compatible server answers at {self.base} ({type(e).__name__}: {e})",
                where="--url",
                fix="start the server first (qconv serve ART, vllm serve ...) or fix host:port",
            ) from e
        if not models:
            raise QconvError(f"{self.base} serves no model", where="--url")
        self.model = self.model or models[0]["id"]
        self.max_model_len = int(models[0].get("max_model_len") or 0)
        return self

    def chat(self, prompt: str, max_tokens: int, timeout: float = 600.0) -> RequestResult:
        """One greedy streaming chat request, timed."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out, parts = RequestResult(), []
        t0 = time.perf_counter()
        last = None
        try:
            with self._request("/v1/chat/completions", body, timeout) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    data = json.loads(line.removeprefix("data:").strip())
                    if "error" in data:
                        raise ValueError(data["error"])
                    if data.get("choices"):
                        c = data["choices"][0]
                        piece = (c.get("delta") or {}).get("content") or ""
                        if last is None and (piece or c.get("finish_reason")):
                            out.ttft = now - t0
                            last = now
                        elif last is not None:
                            out.itl.append(now - last)
                            last = now
                        parts.append(piece)
                    elif usage := data.get("usage"):
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                        out.prompt_len = int(usage.get("prompt_tokens") or 0)
        except (OSError, ValueError) as e:
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else ""
            out.error = f"{type(e).__name__}: {e} {detail}".strip()
        out.latency = (last or time.perf_counter()) - t0
        out.text = "".join(parts)
        return out


def run_load(ep: Endpoint, prompts: list[str], concurrency: int, max_tokens: int, on_done=None):
    """Every prompt once, at most `concurrency` in flight -> (results in prompt order, wall seconds)."""

    def one(p: str) -> RequestResult:
        r = ep.chat(p, max_tokens)
        if on_done is not None:
            on_done(r)
        return r

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(one, prompts))
    return results, time.perf_counter() - t0
