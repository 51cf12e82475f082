"""Hub test helpers: a small fake artifact and a real HTTP server on 127.0.0.1 that can misbehave on purpose.

The server supports Range requests, logs every request (path + Range header), and per path can: cut the body
midway (then close), serve tampered bytes (one byte flipped), stall midway until released, or delay responses.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from qconv.manifest import Manifest, ModuleDecision, RecipeInfo, SourceInfo, hash_artifact_files

BIG = "model-00001-of-00002.safetensors"
SMALL = "model-00002-of-00002.safetensors"
QUALITY = {"kld": {"mean": 0.0123, "p99": 0.21}, "top1_agreement": 0.974, "ppl_ratio": 1.012,
           "gates": {"max_mean_kld": "pass", "min_top1": "pass"}}


def make_artifact(folder: Path) -> Path:
    """A tiny but well-formed qconv artifact: 2 safetensors shards, config, tokenizer, and a real qconv.json."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    save_file({"model.layers.0.mlp.down_proj.weight_packed": rng.integers(-2**31, 2**31 - 1, (128, 512), np.int32),
               "model.layers.0.mlp.down_proj.weight_scale": rng.standard_normal((128, 32)).astype(np.float16)},
              str(folder / BIG))
    save_file({"lm_head.weight": rng.standard_normal((64, 256)).astype(np.float16)}, str(folder / SMALL))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    Manifest(source=SourceInfo(kind="hub", id="Qwen/Qwen3-Tiny", revision="0123abc", architecture="qwen3"),
             recipe=RecipeInfo(name="3090", sha256="ab" * 32, resolved={"default_profile": "fast"}),
             modules=[ModuleDecision("model.layers.0.mlp.down_proj", "mlp.down", "w4a16", 4, 128, [128, 4096])],
             files=hash_artifact_files(folder), quality=QUALITY, status="ok",
             profiles={"fast": {"kv_cache": "bf16", "context_length": 4096}}).write(folder)
    return folder


def flip_byte(data: bytes, at: int | None = None) -> bytes:
    at = len(data) // 2 if at is None else at
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@dataclass
class Behaviour:
    cut: dict[str, int] = field(default_factory=dict)  # path -> how many responses to cut at half the body
    tamper: dict[str, int] = field(default_factory=dict)  # path -> how many responses to tamper (-1: always)
    stall: dict[str, threading.Event] = field(default_factory=dict)  # path -> send half, wait for the event, close
    delay: dict[str, float] = field(default_factory=dict)  # path -> seconds to sleep before answering


class FileServer:
    """ThreadingHTTPServer over `root` in a background thread; `log` holds (path, Range header or None)."""

    def __init__(self, root: Path):
        self.root, self.log, self.b = root, [], Behaviour()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def do_GET(self):
                server.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def _take(self, counts: dict[str, int], path: str) -> bool:
        with self.lock:
            n = counts.get(path, 0)
            if n == 0:
                return False
            if n > 0:
                counts[path] = n - 1
            return True

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        import time

        path = urllib.parse.unquote(urllib.parse.urlparse(h.path).path)
        rng = h.headers.get("Range")
        with self.lock:
            self.log.append((path, rng))
        if path in self.b.delay:
            time.sleep(self.b.delay[path])
        f = (self.root / path.lstrip("/")).resolve()
        if not f.is_file() or self.root.resolve() not in f.parents:
            h.send_error(404)
            return
        data = f.read_bytes()
        if self._take(self.b.tamper, path):
            data = flip_byte(data)
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        if start >= len(data) and rng:
            h.send_error(416)
            return
        body = data[start:]
        h.send_response(206 if rng else 200)
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        stall = self.b.stall.pop(path, None)
        if self._take(self.b.cut, path) or stall:
            h.wfile.write(body[:len(body) // 2])
            h.wfile.flush()
            if stall:
                stall.wait(20)
            h.close_connection = True
            return
        h.wfile.write(body)

    def gets(self, path: str) -> list[str | None]:
        """Range headers of every request for `path` (None for a plain GET)."""
        with self.lock:
            return [r for p, r in self.log if p == path]

    def close(self) -> None:
        for ev in self.b.stall.values():
            ev.set()
        self.httpd.shutdown()
        self.httpd.server_close()
