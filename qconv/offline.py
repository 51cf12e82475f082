"""Offline detection: one TCP probe of the Hugging Face Hub before a job, so an unreachable Hub costs one line
instead of every library's own retries."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from urllib.parse import urlparse


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = 2.0) -> str | None:
    """Why the Hugging Face Hub (HF_ENDPOINT, or the HTTPS proxy in front of it) cannot be reached, or None when a
    TCP connection opens. One cheap check instead of every library's own retries."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as e:
        return f"{host}:{port} unreachable ({e.strerror or type(e).__name__})"


@contextlib.contextmanager
def offline_if_unreachable() -> contextlib.AbstractContextManager[str | None]:
    """HF_HUB_OFFLINE=1 for the block when the Hub cannot be reached, so huggingface_hub, transformers and datasets
    fail at once instead of retrying. Yields the line that says so (None when online or already offline);
    the environment and the libraries' already-read flags are put back afterwards."""
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        yield None
        return
    why = hub_unreachable()
    if why is None:
        yield None
        return
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    env = {k: os.environ.get(k) for k in keys}
    flags = [
        (mod, name)
        for mod, name in (
            ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
            ("datasets.config", "HF_HUB_OFFLINE"),
            ("datasets.config", "HF_DATASETS_OFFLINE"),
        )
        if mod in sys.modules
    ]
    saved = [(sys.modules[m], n, getattr(sys.modules[m], n, None)) for m, n in flags]
    os.environ.update({k: "1" for k in keys})
    for mod, name, _ in saved:
        setattr(mod, name, True)
    try:
        yield f"offline: {why}; HF_HUB_OFFLINE=1 for this run (no network retries)"
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for mod, name, value in saved:
            setattr(mod, name, value)
