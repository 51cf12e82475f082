"""Fault injection for the native OpenAI server (issue 18, Serve): out-of-range fields, one bad request among good
ones, a dead scheduler thread, oversized bodies and prompts, a slow tokenizer, chat without max_tokens, the API
key, /metrics, the Host header; and a load test of 32 streaming clients, 8 of them bad. Each test failed on the
code before its fix (see the branch's notes)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from qconv.engine.sampling import SamplingParams
from qconv.serve.native import NativeOptions, build_native
from qconv.serve.scheduler import GenRequest, Scheduler
from tests.sched_helpers import submit_and_wait
from tests.serve_helpers import BackgroundServer

KEY = "fault-key"
GOOD = ["The quick brown", "First Citizen:", "def add(a, b):", "0123456789 +", "All: Speak", "A tiny model"]


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    app, sched = build_native(tiny_qwen3, NativeOptions(max_batch=4, max_model_len=512, api_key=KEY))
    with BackgroundServer(app, sched) as srv:
        yield srv


def _req(server, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None):
    """One request over http.client. A server that answers before it has read the whole body (413) may close the
    connection while the body is still being written: the answer is read all the same, as real clients do."""
    import http.client

    h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.putrequest(method or ("POST" if body is not None else "GET"), path, skip_host="Host" in h)
        for k, v in {**h, **({"Content-Length": str(len(body))} if body is not None else {})}.items():
            conn.putheader(k, v)
        conn.endheaders()
        if body is not None:
            try:
                conn.send(body)
            except (BrokenPipeError, ConnectionResetError):
                pass
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _post(server, path: str, obj, **kw) -> tuple[int, dict]:
    code, raw = _req(server, path, json.dumps(obj).encode() if not isinstance(obj, bytes) else obj, **kw)
    return code, json.loads(raw)


@pytest.fixture(scope="module")
def model(server, tiny_qwen3) -> str:
    return tiny_qwen3.name


def _metric(server, name: str) -> float:
    code, raw = _req(server, "/metrics")
    assert code == 200
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in raw.decode().splitlines() if ln.startswith(name))


# ---- bounded fields, isolated failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value", [("seed", 2**70), ("top_k", 2**70), ("max_tokens", 2**70), ("n", 2**70), ("seed", -(2**70))]
)
def test_out_of_range_fields_are_400_and_the_server_keeps_serving(server, model, field, value):
    code, err = _post(
        server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 1.0, field: value}
    )
    assert code == 400 and err["error"]["param"] == field, err
    code, ok = _post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4})
    assert code == 200 and ok["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("bad", ["seed", "top_k"])
def test_one_bad_request_ends_alone_in_the_scheduler(tiny_qwen3, bad):
    """Values the protocol now refuses, handed straight to the scheduler (a future field or a bug that slips
    through): only that request ends with an error; the others finish with what they produce alone."""
    from qconv.engine.loader import load_model, load_tokenizer

    tok = load_tokenizer(tiny_qwen3)
    sched = Scheduler(load_model(tiny_qwen3), tok, max_batch=4, max_len=256).start()
    try:
        mk = lambda p: GenRequest(tok(p).input_ids, 12, None)  # noqa: E731
        alone = []
        for p in GOOD[:3]:
            r = mk(p)
            submit_and_wait(sched, [r])
            alone.append(r.out_ids)
        poison = GenRequest(
            tok("hear me speak").input_ids,
            12,
            None,
            SamplingParams(temperature=1.0, top_k=2**70 if bad == "top_k" else 0),
            seed=2**70 if bad == "seed" else None,
        )
        good = [mk(p) for p in GOOD[:3]]
        reasons = submit_and_wait(sched, [good[0], poison, *good[1:]])
        assert reasons[1] == "error"
        assert [reasons[i] for i in (0, 2, 3)] == ["length"] * 3 and [r.out_ids for r in good] == alone
        assert sorted(sched.free) == list(range(4)) and sched.thread.is_alive()
    finally:
        sched.stop()


def test_dead_scheduler_thread_refuses_new_work_with_503(tiny_qwen3):
    from qconv.engine.loader import load_model, load_tokenizer
    from qconv.serve.server import ServerConfig, create_app

    tok = load_tokenizer(tiny_qwen3)
    sched = Scheduler(load_model(tiny_qwen3), tok, max_batch=2, max_len=128)

    def die():
        raise SystemExit("injected: the model thread dies")

    sched.step = die
    sched.start()
    first = GenRequest(tok("hi").input_ids, 4, None)
    assert submit_and_wait(sched, [first]) == {0: "error"}  # what it held is failed, not left waiting
    sched.thread.join(30)
    app = create_app(sched, ServerConfig("m", 128))
    with BackgroundServer(app, sched) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="m", prompt="hi", max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "scheduler_down"


# ---- limits before tokenizing, tokenizing off the loop --------------------------------------------------------------


def test_oversized_body_is_413_before_parsing(server, model):
    cap = 64 * 512 if 64 * 512 > 1 << 20 else 1 << 20
    big = json.dumps({"model": model, "prompt": "x" * (cap + 10)}).encode()
    code, err = _post(server, "/v1/completions", big)
    assert code == 413 and err["error"]["code"] == "body_too_large"


def test_prompt_and_message_caps_before_tokenizing(server, model):
    code, err = _post(server, "/v1/completions", {"model": model, "prompt": "ab " * (32 * 512 // 3 + 10)})
    assert code == 400 and err["error"]["code"] == "context_length_exceeded" and "characters" in err["error"]["message"]
    msgs = [{"role": "user", "content": "hi"}] * 1025
    code, err = _post(server, "/v1/chat/completions", {"model": model, "messages": msgs})
    assert code == 400 and err["error"]["param"] == "messages" and err["error"]["code"] == "too_many_messages"
    code, err = _post(server, "/v1/completions", {"model": model, "prompt": [5] * 600})
    assert code == 400 and err["error"]["code"] == "context_length_exceeded"


class _SlowTokenizer:
    """The real tokenizer, except that a prompt holding MARK blocks until released (a huge prompt)."""

    MARK = "BLOCK-HERE"

    def __init__(self, tok):
        self._tok, self.entered, self.release = tok, threading.Event(), threading.Event()

    def __call__(self, text, *a, **kw):
        if self.MARK in text:
            self.entered.set()
            self.release.wait(120)
        return self._tok(text, *a, **kw)

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_tokenizing_does_not_stall_the_event_loop(tiny_qwen3):
    from qconv.engine.loader import load_model, load_tokenizer
    from qconv.serve.server import ServerConfig, create_app

    tok = _SlowTokenizer(load_tokenizer(tiny_qwen3))
    sched = Scheduler(load_model(tiny_qwen3), tok, max_batch=2, max_len=128).start()
    app = create_app(sched, ServerConfig("m", 128))
    with BackgroundServer(app, sched) as srv, cf.ThreadPoolExecutor(1) as ex:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        slow = ex.submit(c.completions.create, model="m", prompt=f"{tok.MARK} hi", max_tokens=2)
        assert tok.entered.wait(60)
        try:
            # the loop is free while that prompt tokenizes: another request is served meanwhile
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=10) as r:
                assert r.status == 200
            assert c.completions.create(model="m", prompt="hi", max_tokens=2, timeout=30).choices
        finally:
            tok.release.set()
        assert slow.result(120).choices


def test_chat_without_max_tokens_is_capped_by_the_profile(tiny_qwen3):
    from qconv.engine.loader import load_model, load_tokenizer
    from qconv.serve.server import ServerConfig, create_app

    sched = Scheduler(load_model(tiny_qwen3), load_tokenizer(tiny_qwen3), max_batch=1, max_len=512).start()
    app = create_app(sched, ServerConfig("m", 512, max_tokens=5))
    with BackgroundServer(app, sched) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hear me"}],
            temperature=1.0,
            seed=3,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens <= 5


def test_native_plan_takes_the_cap_from_the_profile(tmp_path, tiny_qwen3):
    import shutil

    from qconv.serve.native import DEFAULT_MAX_TOKENS, native_plan

    assert native_plan(tiny_qwen3, NativeOptions()).max_tokens == DEFAULT_MAX_TOKENS
    art = tmp_path / "art"
    shutil.copytree(tiny_qwen3, art)
    from qconv.manifest import Manifest, RecipeInfo, SourceInfo

    Manifest(
        source=SourceInfo(kind="hf_dir", id="x"),
        recipe=RecipeInfo(name="cpu", sha256="0", resolved={}),
        modules=[],
        profiles={"fast": {"kv_cache": "bf16", "context_length": 1024, "max_tokens": 77}},
    ).write(art)
    assert native_plan(art, NativeOptions()).max_tokens == 77


# ---- key, metrics, host --------------------------------------------------------------------------------------


def test_api_key_is_compared_in_constant_time(server, model, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    code, _ = _post(
        server,
        "/v1/completions",
        {"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": "Bearer wrong"},
    )
    assert code == 401 and calls
    code, _ = _post(
        server,
        "/v1/completions",
        {"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": "Bearer ünïcode"},
    )  # a non-ASCII header is a 401, not a 500
    assert code == 401


def test_metrics_need_the_key_when_one_is_set(server):
    assert _req(server, "/metrics", headers={"Authorization": ""})[0] == 401
    assert _req(server, "/metrics")[0] == 200


def test_foreign_host_header_is_refused_on_loopback(server, model):
    code, err = _post(
        server,
        "/v1/completions",
        {"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"Host": "evil.example:8000"},
    )
    assert code == 400 and err["error"]["code"] == "invalid_host"
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}"):
        assert _req(server, "/health", headers={"Host": host})[0] == 200


def test_public_bind_without_a_key_is_refused_and_key_on_argv_warned(tiny_qwen3, monkeypatch):
    """A non-loopback bind needs a key (the Host check can only hold on loopback): refused before loading, on both
    backends; with a key, or on loopback, it serves."""
    from click.testing import CliRunner

    import qconv.serve.native as native
    from qconv.cli import main
    from qconv.errors import QconvError

    with pytest.raises(QconvError, match="serving on 0.0.0.0 without an API key"):
        native.check_bind("0.0.0.0", None)
    native.check_bind("0.0.0.0", "k")
    native.check_bind("127.0.0.1", None)
    monkeypatch.setattr(native, "run_native", lambda path, opts, art=None: None)
    monkeypatch.delenv("QCONV_API_KEY", raising=False)
    for backend in ("native", "vllm"):
        r = CliRunner().invoke(main, ["serve", str(tiny_qwen3), "--backend", backend, "--host", "0.0.0.0"])
        assert r.exit_code != 0 and "QCONV_API_KEY" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, ["serve", str(tiny_qwen3), "--backend", "native", "--api-key", "sekrit"])
    assert r.exit_code == 0 and "QCONV_API_KEY" in r.output
    r = CliRunner().invoke(
        main, ["serve", str(tiny_qwen3), "--backend", "native", "--host", "0.0.0.0"], env={"QCONV_API_KEY": "sekrit"}
    )
    assert r.exit_code == 0 and "QCONV_API_KEY" not in r.output, r.output


def test_with_a_key_the_schema_needs_it_and_health_says_only_ok(server):
    code, _ = _req(server, "/openapi.json", headers={"Authorization": ""})
    assert code == 401
    code, body = _req(server, "/openapi.json")
    assert code == 200 and "/v1/completions" in json.loads(body)["paths"]
    code, body = _req(server, "/health", headers={"Authorization": ""})
    assert code == 200 and json.loads(body) == {"status": "ok"}


# ---- load: 32 streaming clients, 8 bad ---------------------------------------------------------------------


def test_32_streaming_clients_8_bad_good_ones_unaffected(tiny_qwen3):
    from tests.serve_helpers import stream_one

    app, sched = build_native(tiny_qwen3, NativeOptions(max_batch=8, max_queue=64, max_model_len=512))
    prompts = [f"{GOOD[i % len(GOOD)]} {i}" for i in range(24)]
    name = tiny_qwen3.name
    with BackgroundServer(app, sched) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=300)
        alone = {p: stream_one(c, name, p, 16, chat=False).text for p in prompts}

        def oversized():
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model=name, prompt="x" * (2 << 20), max_tokens=4, stream=True)
            return e.value.status_code

        def huge_seed():
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model=name, prompt="hi", max_tokens=4, seed=2**70, stream=True)
            return e.value.status_code

        def disconnect():
            stream = c.completions.create(model=name, prompt="The quick", max_tokens=400, temperature=0.8, stream=True)
            for i, _ in enumerate(stream):
                if i == 2:
                    break
            stream.close()
            return "closed"

        def malformed():
            r = httpx.post(
                f"{srv.base_url}/completions",
                content=b'{"model": "x", "prompt": ',
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            return r.status_code

        def refused(**extra):
            def send():
                msgs = [{"role": "user", "content": "hi"}]
                r = httpx.post(
                    f"{srv.base_url}/chat/completions",
                    json={"model": name, "messages": msgs, "max_tokens": 4, **extra},
                    timeout=60,
                )
                return r.status_code

            return send

        penalty = refused(frequency_penalty=2.5)  # out of range
        tools = refused(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")
        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        vision = refused(messages=[{"role": "user", "content": image}])
        bad = [oversized, huge_seed, disconnect, malformed, penalty, tools, vision]
        held = [_open(srv.port) for _ in range(50)] + [_open(srv.port, HALF_SENT) for _ in range(50)]  # idle, half
        with cf.ThreadPoolExecutor(32) as ex:
            good_f = [ex.submit(stream_one, c, name, p, 16, False) for p in prompts]
            bad_f = [ex.submit(f) for f in bad]
            good = {p: f.result().text for p, f in zip(prompts, good_f)}
            bad_codes = [f.result() for f in bad_f]
        for s in held:
            s.close()
        assert good == alone
        assert [b for b in bad_codes if b != "closed"] and all(400 <= b < 500 for b in bad_codes if b != "closed")

        def gauges() -> tuple[float, float]:
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics") as r:
                lines = r.read().decode().splitlines()
            names = ("qconv_running_requests", "qconv_queue_depth")
            return tuple(float(next(ln for ln in lines if ln.startswith(n + " ")).split()[1]) for n in names)

        # The scheduler frees a slot inside its step and sets the gauges at the step's end: poll, on a loaded
        # machine the two may be read between.
        deadline = time.monotonic() + 60
        while sched.active or sched.waiting or gauges() != (0, 0):
            assert time.monotonic() < deadline, f"slots not freed: running, queued = {gauges()}"
            time.sleep(0.1)
        assert sorted(sched.free) == list(range(8)) and sched.thread.is_alive()
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health") as r:
            assert r.status == 200


# ---- hostile inputs (issue 34) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [{"99999999": 100}, {"1": -100}, {"1": 500}, "x"])
def test_logit_bias_is_refused_not_silently_ignored(server, model, bias):
    """The server cannot apply logit_bias: a client asking for it is told (400), never answered as if it were."""
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        code, err = _post(server, path, {"model": model, "max_tokens": 4, "logit_bias": bias, **body})
        assert code == 400 and err["error"]["param"] == "logit_bias", err
    code, ok = _post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "logit_bias": {}})
    assert code == 200  # an empty bias asks for nothing


def _truncate(folder: Path) -> Path:
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


def test_serve_eval_and_check_refuse_a_truncated_weight_file(tiny_qwen3, tmp_path):
    """One error naming the file (exit 2) before any library reads it: serve (native), eval, check."""
    from qconv.errors import QconvError
    from qconv.eval.record import EvalSettings
    from qconv.eval.run import check, evaluate
    from tests.cli_helpers import run as cli
    from tests.hub_server import make_artifact

    folder = shutil.copytree(tiny_qwen3, tmp_path / "plain")
    shard = _truncate(folder)
    r = cli("serve", folder, "--backend", "native", "--port", "18200")
    assert r.exit_code == 2 and "corrupt or truncated safetensors" in r.stderr and str(shard) in r.stderr, r.output
    art = make_artifact(tmp_path / "art")
    shard = _truncate(art)
    for verb in (lambda: evaluate(art, EvalSettings("t")), lambda: check(art)):
        with pytest.raises(QconvError, match="corrupt or truncated safetensors") as e:
            verb()
        assert str(shard) in str(e.value)


def test_serve_checks_the_artifact_hashes_before_loading(tmp_path):
    from tests.cli_helpers import run as cli
    from tests.hub_server import SMALL, flip_byte, make_artifact

    art = make_artifact(tmp_path / "art")
    (art / SMALL).write_bytes(flip_byte((art / SMALL).read_bytes(), at=200))
    r = cli("serve", art, "--backend", "native", "--port", "18201")
    assert r.exit_code == 1 and f"{SMALL}: sha256" in r.stderr and "do not match qconv.json" in r.stderr, r.output


# ---- hostile inputs, round 2 ---------------------------------------------------------------------------------------


def _open(port: int, first: bytes = b""):
    import socket

    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    if first:
        s.sendall(first)
    return s


def _answer(s) -> bytes:
    """What the server sent before it closed the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


HALF_SENT = b'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{"model": '


def test_idle_and_half_sent_connections_do_not_starve_a_normal_request(tiny_qwen3):
    """300 connections that send nothing and 100 that stop halfway through a body: a normal request beside them is
    answered, each of them is closed with a 408 once its deadline passes, and their closing is logged once, not
    400 times."""
    from qconv.serve.limits import ConnectionLimits

    app, sched = build_native(tiny_qwen3, NativeOptions(max_batch=2, max_model_len=256))
    limits = ConnectionLimits(max_connections=1000, request_timeout_s=3)
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record):
            self.records.append(record)

    seen = Records()
    with BackgroundServer(app, sched, limits=limits) as srv:
        logging.getLogger("uvicorn.error").addHandler(seen)  # after uvicorn's logging config, which resets handlers
        idle = [_open(srv.port) for _ in range(300)]
        half = [_open(srv.port, HALF_SENT) for _ in range(100)]
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        done = c.completions.create(model=tiny_qwen3.name, prompt="The quick", max_tokens=4, temperature=0)
        assert done.choices[0].text is not None
        answers = [_answer(s) for s in idle + half]
        assert all(a.startswith(b"HTTP/1.1 408") and b"request_timeout" in a for a in answers), answers[0]
        for s in idle + half:
            s.close()
        logging.getLogger("uvicorn.error").removeHandler(seen)
        warned = [r for r in seen.records if "not received whole" in r.getMessage()]
        assert 1 <= len(warned) <= 2, len(warned)  # rate-limited: one, and one more if a 10 s window passed
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=60) as r:
            assert r.status == 200


def test_connections_past_the_cap_are_answered_503_at_once(tiny_qwen3):
    """With the cap at 20, 60 idle connections hold 20 descriptors: the other 40 get a 503 without sending a byte,
    and once the held ones time out a normal request is served again."""
    from qconv.serve.limits import ConnectionLimits

    app, sched = build_native(tiny_qwen3, NativeOptions(max_batch=2, max_model_len=256))
    limits = ConnectionLimits(max_connections=20, request_timeout_s=3)
    with BackgroundServer(app, sched, limits=limits) as srv:
        socks = [_open(srv.port) for _ in range(60)]
        answers = [_answer(s) for s in socks]
        busy = [a for a in answers if a.startswith(b"HTTP/1.1 503") and b"too_many_connections" in a]
        timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
        assert len(busy) == 40 and len(timed_out) == 20, (len(busy), len(timed_out))
        for s in socks:
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=60) as r:
            assert r.status == 200


REFUSED = [
    ("response_format", {"type": "json_object"}, None),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, None),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], None),
    ("tool_choice", "required", None),
    ("suffix", "tail", "/v1/completions"),
    ("best_of", 3, "/v1/completions"),
]


@pytest.mark.parametrize("field,value,only", REFUSED)
def test_parameters_the_engine_cannot_honour_are_refused_by_name(server, model, field, value, only):
    """Each is a 400 naming the field, never a 200 that ignored it; at its neutral value it asks for nothing."""
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        if only and path != only:
            continue
        code, err = _post(server, path, {"model": model, "max_tokens": 2, field: value, **body})
        assert code == 400 and err["error"]["param"] == field and field in err["error"]["message"], err
    neutral = {"response_format": {"type": "text"}, "tools": []}
    neutral |= {"tool_choice": "none", "suffix": "", "best_of": 1}
    code, ok = _post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, **neutral})
    assert code == 200, ok


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_a_vision_request_is_one_clear_400(server, model, part):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    code, err = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": msgs})
    assert code == 400 and "serves text only" in err["error"]["message"], err
    assert err["error"]["message"].startswith("messages[0].content[1]"), err
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    code, _ = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": msgs})
    assert code == 200


def test_connection_limits_from_the_command_line(tiny_qwen3, monkeypatch, tmp_path):
    """--max-connections / --request-timeout reach the native server; vLLM's only through the plugin's front door
    (tests/test_vllm_frontdoor.py): without a plugin they are refused, not dropped."""
    from click.testing import CliRunner

    import qconv.serve.native as native
    from qconv.cli import main
    from qconv.serve.limits import ConnectionLimits

    seen = []
    monkeypatch.setattr(native, "run_native", lambda path, opts, art=None: seen.append(opts.limits))
    args = ["serve", str(tiny_qwen3), "--max-connections", "20", "--request-timeout", "2.5"]
    r = CliRunner().invoke(main, [*args, "--backend", "native"])
    assert r.exit_code == 0, r.output
    assert seen == [ConnectionLimits(max_connections=20, request_timeout_s=2.5)]
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))  # no managed runtime: no plugin known
    r = CliRunner().invoke(main, [*args, "--recipe", "3090", "--backend", "vllm", "--print-command"])
    assert r.exit_code != 0 and "--max-connections needs the qconv-vllm plugin" in r.output, r.output


FUZZ_VALUES = [None, 0, 1, -1, 2.5, -3.0, 1e308, "x", "", [], [1, "a"], {}, {"type": "json_object"}, True, 2**70]
FUZZ_FIELDS = [
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "tools",
    "tool_choice",
    "suffix",
    "best_of",
    "logprobs",
    "logit_bias",
    "n",
    "stop",
    "seed",
    "top_k",
    "temperature",
]
FUZZ_PARTS = [
    {"type": "text", "text": "hi"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio"},
    {"type": 7},
    {"text": "no type"},
    "bare string",
]


def test_fuzzed_requests_are_answered_200_or_one_4xx(server, model):
    """240 seeded requests mixing the parameters above with random values and random chat parts: each is a 200 or a
    4xx with an OpenAI error body (never a 500, never a hang), and a greedy request afterwards gives what it gave
    before."""
    import random

    rng = random.Random(47)
    plain = {"model": model, "prompt": "The quick brown", "max_tokens": 4, "temperature": 0}
    code, before = _post(server, "/v1/completions", plain)
    assert code == 200
    for i in range(240):
        body = {"model": model, "max_tokens": rng.choice([1, 2])}
        for field in rng.sample(FUZZ_FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(FUZZ_VALUES)
        if i % 2:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": rng.sample(FUZZ_PARTS, rng.randint(1, 3))}]
        else:
            path, body["prompt"] = "/v1/completions", "hi"
        code, answer = _post(server, path, body)
        assert code == 200 or (400 <= code < 500 and answer["error"]["message"]), (body, code, answer)
    code, after = _post(server, "/v1/completions", plain)
    assert code == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]


def test_repetition_penalties_reach_the_sampler(server, model):
    """frequency_penalty / presence_penalty are honoured (tests/test_serve_scheduler.py checks the values): the same
    greedy request answers otherwise with them; out of [-2, 2] is a 400 naming the field."""
    body = {"model": model, "prompt": "The quick brown", "max_tokens": 16, "temperature": 0}
    texts = {}
    for extra in ({}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        code, answer = _post(server, "/v1/completions", {**body, **extra})
        assert code == 200, answer
        texts[tuple(extra)] = answer["choices"][0]["text"]
    assert texts[()] != texts[("frequency_penalty",)] and texts[()] != texts[("presence_penalty",)]
    code, err = _post(server, "/v1/completions", {**body, "presence_penalty": 3})
    assert code == 400 and err["error"]["param"] == "presence_penalty", err
