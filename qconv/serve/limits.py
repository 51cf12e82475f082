"""qconv's own server's connection settings: the limits themselves are the plugin's (qconv_vllm.limits, shared with
the vLLM server qconv launches); here what only qconv's server needs: its uvicorn Config and the loopback check."""

from __future__ import annotations

import ipaddress

from qconv_vllm.limits import HEADER_BYTES, rate_limit_logs, uvicorn_kwargs
from qconv_vllm.limits import ConnectionLimits as ConnectionLimits


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (the serve command and the Host check both ask)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits, log_level: str = "info"):
    """uvicorn's Config for `app` under `limits` (fitted to the descriptor limit), with its noisy loggers rate-limited."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        h11_max_incomplete_event_size=HEADER_BYTES,
        timeout_graceful_shutdown=5,
        **uvicorn_kwargs(limits),
    )
    rate_limit_logs()
    return config
