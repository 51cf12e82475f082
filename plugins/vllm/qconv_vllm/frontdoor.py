"""vLLM's OpenAI API server as qconv launches it: `python -m qconv_vllm.frontdoor VLLM_ARGS...`.

The same server vLLM's `api_server` runs, with what qconv's own server holds at its door:
- qconv's connection limits (limits.py: a connection cap answered 503, a deadline for a request to arrive whole
  answered 408), read from QCONV_MAX_CONNECTIONS / QCONV_REQUEST_TIMEOUT and handed to vLLM's uvicorn as options;
- with `--middleware qconv_vllm.frontdoor.TextOnly` (qconv adds it when no vision tower is loaded), a chat request
  carrying an image, audio or video part is refused with qconv's own 400 ("serves text only") before vLLM parses
  it, as qconv's engine does, instead of vLLM's "not a multimodal model" or a failure inside the model.
vLLM's internals used here are checked in patches.py (`relied_on`)."""

from __future__ import annotations

import hmac
import json
import os
import sys

from qconv_vllm.limits import ConnectionLimits, uvicorn_kwargs

CHAT_PATHS = ("/v1/chat/completions", "/v1/responses")
MEDIA = ("image", "audio", "video")  # a content part whose type names one of these
MAX_BODY = 64 << 20  # larger bodies are left to vLLM (which would read them anyway): not held twice here


def media_part(body: bytes) -> tuple[str, str, str] | None:
    """(message path, part type, param) of the first non-text content part of a chat request body, None when
    there is none (or the body is not a chat request qconv can read: vLLM answers those)."""
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    for key in ("messages", "input"):
        msgs = req.get(key)
        for i, m in enumerate(msgs if isinstance(msgs, list) else []):
            parts = m.get("content") if isinstance(m, dict) else None
            for j, p in enumerate(parts if isinstance(parts, list) else []):
                kind = p.get("type") if isinstance(p, dict) else None
                if isinstance(kind, str) and any(w in kind for w in MEDIA):
                    return f"{key}[{i}].content[{j}]", kind, f"{key}[{i}].content"
    return None


def refusal(where: str, kind: str, param: str) -> bytes:
    """qconv's engine's answer to the same request (qconv/serve/protocol.py), in OpenAI's error shape."""
    message = f"{where} is a {kind!r} part: this server serves text only"
    err = {"message": message, "type": "invalid_request_error", "param": param, "code": "text_only"}
    return json.dumps({"error": err}).encode()


class TextOnly:
    """ASGI middleware: a chat request with an image, audio or video part is answered 400 before vLLM sees it.

    A request without the API key (when one is set) goes on to vLLM's own check (a 401), so the refusal tells an
    unauthenticated client nothing."""

    def __init__(self, app):
        self.app = app
        self.key = os.environ.get("VLLM_API_KEY") or ""

    def authorized(self, scope) -> bool:
        if not self.key:
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(auth, f"Bearer {self.key}".encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHAT_PATHS:
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more and size <= MAX_BODY:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left: nothing to answer
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        found = None if more or not self.authorized(scope) else media_part(body)
        if found is not None:
            payload = refusal(*found)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": more}

        await self.app(scope, replay, send)


def main(argv: list[str] | None = None) -> None:
    """vLLM's `api_server` main (vllm/entrypoints/launchers/api_server/entry.py), with qconv's limits as uvicorn
    options."""
    import uvloop
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from qconv_vllm import patches

    patches.current("api_server_run")  # checked: run_server(args, **uvicorn_kwargs) hands them to uvicorn
    patches.current("api_server_uvicorn")
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM's OpenAI API server, with qconv's limits."))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    options = uvicorn_kwargs(ConnectionLimits.from_env(os.environ))
    options.pop("timeout_keep_alive")  # vLLM passes its own (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s as qconv's)
    uvloop.run(entry.run_server(args, **options))


if __name__ == "__main__":
    main()
