"""Connection limits of an HTTP server qconv runs (its own, and vLLM's API server when qconv launches it), on
uvicorn's own settings where it has one and on its h11 protocol where it has none. In the plugin, since vLLM's
environment has no qconv; qconv's server imports it from here.

uvicorn bounds requests (`limit_concurrency`: a 503 past it) and idle keep-alive connections (`timeout_keep_alive`),
but not connections: one that sends nothing, or half a request, is held forever, so ten thousand of them take every
file descriptor and the next accept fails with EMFILE (and asyncio logs each failure). Here:
- at most `max_connections` are held; one past it is answered 503 and closed at once, so descriptors stay bounded
  (the process's soft descriptor limit is raised to its hard limit first, and the cap kept under it);
- a request must arrive whole (headers and body) within `request_timeout_s` of its connection opening or of the
  previous response; otherwise 408 and the connection is closed. A request being answered (a long generation) is
  not timed;
- the same warning or error from uvicorn or asyncio is logged at most once per `LOG_EVERY_S`, then with a count of
  those suppressed, so a flood of bad connections cannot flood the log."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
FD_RESERVE = 128  # descriptors kept for the model's files, logs and the scheduler
HEADER_BYTES = 64 * 1024  # h11's cap on a request line + headers still incomplete
ENV_MAX_CONNECTIONS, ENV_REQUEST_TIMEOUT = "QCONV_MAX_CONNECTIONS", "QCONV_REQUEST_TIMEOUT"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    request_timeout_s: float = 30.0  # headers and body, from connect (or the previous response) to the last byte
    keep_alive_s: int = 5  # uvicorn's idle time between requests on a kept-alive connection
    backlog: int = 1024  # the listen queue (uvicorn's `backlog`)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ConnectionLimits:
        """The limits qconv hands a vLLM it launches (ENV_MAX_CONNECTIONS, ENV_REQUEST_TIMEOUT); defaults elsewhere."""
        c = cls()
        return cls(
            int(env.get(ENV_MAX_CONNECTIONS, c.max_connections)),
            float(env.get(ENV_REQUEST_TIMEOUT, c.request_timeout_s)),
        )

    def env(self) -> dict[str, str]:
        return {ENV_MAX_CONNECTIONS: str(self.max_connections), ENV_REQUEST_TIMEOUT: f"{self.request_timeout_s:g}"}

    def fitted(self) -> ConnectionLimits:
        """These limits with the descriptor limit raised to its hard limit, and the connection cap and listen queue
        kept under it (asyncio accepts up to a listen queue's worth before the first is refused)."""
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or hard > soft:
                want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
        except (ImportError, ValueError, OSError):
            return self
        backlog = max(16, min(self.backlog, soft // 4))
        cap = max(16, min(self.max_connections, soft - backlog - FD_RESERVE))
        if cap < self.max_connections:
            log.warning("at most %d connections (the descriptor limit is %d)", cap, soft)
        return ConnectionLimits(cap, self.request_timeout_s, self.keep_alive_s, backlog)


def raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def protocol_for(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol with the connection cap and the request deadline (the `http` class for uvicorn)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = raw_response(
        503,
        "Service Unavailable",
        f"server busy: {limits.max_connections} connections open; retry later",
        "too_many_connections",
    )
    slow = raw_response(
        408,
        "Request Timeout",
        f"the request did not arrive whole within {limits.request_timeout_s:g} s",
        "request_timeout",
    )

    class LimitedH11Protocol(H11Protocol):
        deadline = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                n = len(self.connections) - 1
                self.logger.warning("connection limit reached (%d open): new connections answered 503", n)
                self.connections.discard(self)  # not held: it must not count against the others' requests
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self.deadline = self.loop.call_later(limits.request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            self.deadline = None
            c = self.cycle
            if self.transport.is_closing() or (c is not None and not c.response_complete and not c.more_body):
                return  # closed already, or a whole request being answered (re-armed when its response ends)
            if c is None or c.response_complete or not c.response_started:
                self.transport.write(slow)
            self.logger.warning("request not received whole within %gs: connection closed", limits.request_timeout_s)
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return LimitedH11Protocol


class RateLimited(logging.Filter):
    """Lets each distinct message template through at most once per `every` seconds; the next one that passes says
    how many were held back."""

    def __init__(self, every: float = LOG_EVERY_S):
        super().__init__()
        self.every = every
        self.seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key, now = str(record.msg), time.monotonic()
        last, held = self.seen.get(key, (-float("inf"), 0))
        if now - last < self.every:
            self.seen[key] = (last, held + 1)
            return False
        self.seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {now - last:.0f} s)"
        return True


RATE_LIMITED_LOGGERS = ("uvicorn.error", "asyncio")


def uvicorn_kwargs(limits: ConnectionLimits) -> dict:
    """uvicorn's Config options for `limits` (fitted to the descriptor limit first): qconv's server and the vLLM
    server qconv launches (frontdoor.py) pass the same."""
    fit = limits.fitted()
    return {
        "http": protocol_for(fit),
        "limit_concurrency": fit.max_connections + 1,  # a backstop: the cap above already holds connections
        "timeout_keep_alive": fit.keep_alive_s,
        "backlog": fit.backlog,
    }


def rate_limit_logs() -> None:
    """One RateLimited filter on each of uvicorn's and asyncio's noisy loggers, its window started afresh (after
    uvicorn's Config, which configures its logging)."""
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, RateLimited)]:
            logger.removeFilter(f)
        logger.addFilter(RateLimited())
