"""The OpenAI-compatible HTTP server over qconv's engine (FastAPI): handlers tokenize (in a worker thread, so a long
prompt does not stall other streams), check limits, submit to the scheduler thread and relay its events.

What a client sends is bounded before it costs anything: the body size (before JSON parsing), the prompt's characters
and the message count (before tokenizing), every numeric field (protocol.py). On a loopback bind only loopback Host
headers are served (a web page cannot reach the server by DNS rebinding)."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qconv.engine.sampling import SamplingParams
from qconv.serve.limits import is_loopback
from qconv.serve.protocol import APIError, ChatRequest, CompletionRequest, validation_error
from qconv.serve.scheduler import Event, GenRequest, QueueFull, Scheduler, SchedulerDown

DISCONNECT_POLL_S = 0.5
MAX_MESSAGES = 1024
CHARS_PER_TOKEN = 32  # prompts longer than this many characters per context token are refused untokenized


@dataclass
class ServerConfig:
    model_name: str
    context_len: int
    api_key: str | None = None
    max_tokens: int | None = None  # completion cap of a chat request that sends none (the profile's); None: context
    host: str = "127.0.0.1"  # the bind address

    @property
    def body_cap(self) -> int:
        return max(1 << 20, 64 * self.context_len)

    @property
    def prompt_chars(self) -> int:
        return CHARS_PER_TOKEN * self.context_len


def _host_of(header: str) -> str:
    """The host part of a Host header (`127.0.0.1:8000`, `[::1]:8000`, `localhost`)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """ASGI middleware in front of FastAPI: the Host check on a loopback bind, and the body cap (Content-Length,
    then the bytes actually received) before anything parses the body."""

    def __init__(self, app, cfg: ServerConfig, reject):
        self.app, self.cfg, self.reject = app, cfg, reject

    async def _refuse(self, scope, receive, send, e: APIError) -> None:
        self.reject(e.status)
        await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if is_loopback(self.cfg.host) and host is not None and not is_loopback(_host_of(host)):
            return await self._refuse(
                scope,
                receive,
                send,
                APIError(
                    400, f"Host {host!r} is not served: this server listens on loopback only", code="invalid_host"
                ),
            )
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        cap = self.cfg.body_cap
        too_big = APIError(413, f"request body larger than {cap} bytes", code="body_too_large")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            return await self._refuse(
                scope,
                receive,
                send,
                too_big if length.isdigit() else APIError(400, "bad Content-Length header", code="invalid_request"),
            )
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > cap:
                return await self._refuse(scope, receive, send, too_big)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # then the real stream: http.disconnect when the client goes

        return await self.app(scope, replay, send)


def create_app(sched: Scheduler, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="qconv", docs_url=None, redoc_url=None, openapi_url=None)  # its schema: behind the key
    tok = sched.tokenizer
    metrics = sched.metrics
    app.add_middleware(RequestGuard, cfg=cfg, reject=metrics.reject)
    expected_auth = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    def error_response(e: APIError) -> JSONResponse:
        metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        return error_response(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind))

    async def check_key(request: Request) -> None:
        got = request.headers.get("authorization", "").encode("latin-1", "replace")
        if expected_auth is not None and not hmac.compare_digest(got, expected_auth):  # constant time
            what = "incorrect API key" if request.headers.get("authorization") else "missing API key"
            raise APIError(401, f"{what}: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    @app.get("/openapi.json", dependencies=[Depends(check_key)], include_in_schema=False)
    async def openapi():
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health():
        """Open without the key (load balancers probe it): it says only ok or dead."""
        ok = sched.thread is not None and sched.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "dead"}, status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=[Depends(check_key)])
    async def prom():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "qconv",
                    "max_model_len": cfg.context_len,
                }
            ],
        }

    async def start(body, prompt_ids: list[int], max_tokens: int | None) -> tuple[GenRequest, asyncio.Queue]:
        """Check the request against this server, and submit it; its events arrive on the returned queue."""
        if body.model != cfg.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {cfg.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
        refused = body.refused()
        if refused is not None:
            field, why = refused
            raise APIError(
                400, f"{field} is not supported by this server: {why}", param=field, code="unsupported_value"
            )
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        n = len(prompt_ids)
        want = max_tokens if max_tokens is not None else min(cfg.max_tokens or cfg.context_len, cfg.context_len - n)
        if n + want > cfg.context_len or want < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {cfg.context_len} tokens. However, you "
                f"requested {n + max(want, 1)} tokens ({n} in the prompt, {max(want, 1)} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param="max_tokens" if max_tokens else "messages",
                code="context_length_exceeded",
            )
        sp = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
        )
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        r = GenRequest(
            prompt_ids, want, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev), sp, body.seed, body.stop_list()
        )
        try:
            sched.submit(r)
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", "rate_limit_exceeded", code="queue_full") from e
        except SchedulerDown as e:
            raise APIError(503, f"server unavailable: {e}", "server_error", code="scheduler_down") from e
        return r, q

    async def events(r: GenRequest, q: asyncio.Queue, request: Request) -> AsyncIterator[Event]:
        """The request's events until its last; a client that goes away cancels the work in the scheduler."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                if loop.time() - checked >= DISCONNECT_POLL_S:
                    checked = loop.time()
                    if await request.is_disconnected():
                        return
                if ev is None:
                    continue
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            r.cancel()  # no-op once finished; frees the slot when the client left early

    def usage(ev: Event) -> dict:
        return {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }

    async def respond(body, r, q, request, chat: bool):
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

        def envelope(obj: str, **rest) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": cfg.model_name, **rest}

        if not body.stream:
            text, last = [], Event()
            async for ev in events(r, q, request):
                text.append(ev.text)
                last = ev
            if last.finish_reason == "error":
                raise APIError(500, f"generation failed: {last.error}", "server_error")
            choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            return envelope("chat.completion" if chat else "text_completion", choices=[choice], usage=usage(last))

        obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if delta_text:
                    delta["content"] = delta_text
                c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return sse(envelope(obj, choices=[c]))

        async def stream():
            if chat:
                yield chunk(None, None, first=True)
            async for ev in events(r, q, request):
                if ev.finish_reason == "error":
                    yield sse(APIError(500, f"generation failed: {ev.error}", "server_error").body())
                    return
                if ev.text or ev.finish_reason:
                    yield chunk(ev.text or None, ev.finish_reason)
                if ev.finish_reason and body.include_usage:
                    yield sse(envelope(obj, choices=[], usage=usage(ev)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def too_long(n: int, unit: str, param: str) -> APIError:
        cap = cfg.prompt_chars if unit == "characters" else cfg.context_len
        return APIError(
            400,
            f"the prompt is {n} {unit}; this server accepts at most {cap} (context {cfg.context_len} tokens)",
            param=param,
            code="context_length_exceeded",
        )

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (batch prompts are not supported)", param="prompt")
            p = p[0]
        if len(p) > (cfg.prompt_chars if isinstance(p, str) else cfg.context_len):
            raise too_long(len(p), "characters" if isinstance(p, str) else "tokens", "prompt")
        ids = await asyncio.to_thread(lambda: tok(p).input_ids) if isinstance(p, str) else list(p)
        if any(not 0 <= t < len(tok) for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {len(tok)})", param="prompt")
        r, q = await start(body, ids, body.max_tokens if body.max_tokens is not None else 16)
        return await respond(body, r, q, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(body: ChatRequest, request: Request):
        if len(body.messages) > MAX_MESSAGES:
            raise APIError(
                400,
                f"{len(body.messages)} messages; this server accepts at most {MAX_MESSAGES}",
                param="messages",
                code="too_many_messages",
            )
        msgs = [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(body.messages)]
        chars = sum(len(m["content"]) for m in msgs)
        if chars > cfg.prompt_chars:
            raise too_long(chars, "characters", "messages")

        def template() -> list[int]:
            try:
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template that rejects this conversation (roles order, ...)
                raise APIError(400, f"chat template rejected the messages: {e}", param="messages") from e
            return tok(text, add_special_tokens=False).input_ids

        ids = await asyncio.to_thread(template)
        r, q = await start(body, ids, body.max_completion_tokens or body.max_tokens)
        return await respond(body, r, q, request, chat=True)

    return app
