"""The native OpenAI server on a tiny model, driven by the real `openai` client: chat, completions, streaming, stop
sequences, errors (with the server still serving afterwards), API key, queue bound, client disconnects, metrics."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from qconv.serve.native import NativeOptions, build_native
from tests.serve_helpers import BackgroundServer

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    app, sched = build_native(tiny_qwen3, NativeOptions(max_batch=4, max_model_len=4096, api_key=KEY))
    with BackgroundServer(app, sched) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(server, client):
    return client.models.list().data[0].id


def _post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(client, model, prompt="The quick brown", **kw):
    return client.completions.create(model=model, prompt=prompt, **{"max_tokens": 24, "temperature": 0, **kw})


def test_models_and_chat(client, model, tiny_qwen3):
    assert model == tiny_qwen3.name
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hear me speak"}], max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client, model):
    full = _complete(client, model)
    chunks = list(
        client.completions.create(model=model, prompt="The quick brown", max_tokens=24, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    msgs = [{"role": "user", "content": "print(add(2, 3))"}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    parts, usage = [], None
    for c in stream:
        usage = c.usage or usage
        parts += [c.choices[0].delta.content or ""] if c.choices else []
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_sequences(client, model):
    full = _complete(client, model, max_tokens=40).choices[0].text
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    want = full[: full.find(stop)]
    r = _complete(client, model, max_tokens=40, stop=[stop, "\x00never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model, prompt="The quick brown", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want


def test_seeded_sampling_is_reproducible(client, model):
    kw = dict(temperature=1.0, top_p=0.9, extra_body={"top_k": 50}, seed=7, max_tokens=40)
    a, b = (_complete(client, model, **kw).choices[0].text for _ in range(2))
    assert a == b
    assert a != _complete(client, model, **{**kw, "seed": 8}).choices[0].text


def test_concurrent_greedy_equals_single(client, model):
    prompts = ["The quick brown", "First Citizen:", "def add(a, b):", "0123456789 +", "All: Speak", "A tiny model"]
    single = {p: _complete(client, model, prompt=p).choices[0].text for p in prompts}
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        together = dict(zip(prompts, ex.map(lambda p: _complete(client, model, prompt=p).choices[0].text, prompts)))
    assert together == single


def test_errors_are_openai_bodies_and_server_keeps_serving(server, client, model):
    cases = [
        (b'{"model": "x", "prompt": ', 400, None),  # malformed JSON
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": model, "prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": model}).encode(), 400, "prompt"),
        (json.dumps({"model": model, "prompt": "hi", "n": 2}).encode(), 400, "n"),
        (json.dumps({"model": model, "prompt": "hi", "logprobs": 2}).encode(), 400, "logprobs"),
        (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404, "model"),
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": 5000}).encode(), 400, "max_tokens"),
    ]
    for body, status, param in cases:
        code, err = _post(server, "/v1/completions", body)
        assert code == status, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
        if param:
            assert err["error"]["param"] == param, err
    code, err = _post(
        server, "/v1/completions", json.dumps({"model": model, "prompt": "hi", "max_tokens": 5000}).encode()
    )
    assert "4096" in err["error"]["message"] and err["error"]["code"] == "context_length_exceeded"
    code, err = _post(server, "/v1/chat/completions", json.dumps({"model": model, "messages": []}).encode())
    assert code == 400 and err["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=9999)
    assert _complete(client, model, max_tokens=4).usage.completion_tokens >= 1  # still serving


def test_api_key(server, model):
    for headers, what in [({"Authorization": ""}, "missing"), ({"Authorization": "Bearer wrong"}, "incorrect")]:
        code, err = _post(server, "/v1/completions", json.dumps({"model": model, "prompt": "hi"}).encode(), headers)
        assert code == 401 and what in err["error"]["message"] and err["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health") as r:  # health needs no key
        assert r.status == 200


def _metric(server, name: str) -> float:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:  # /metrics is behind the key when the server has one
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def test_disconnect_cancels_and_metrics(server, client, model):
    before = _metric(server, 'qconv_requests_total{status="cancelled"}')
    stream = client.completions.create(
        model=model, prompt="The quick brown", max_tokens=4000, temperature=0.8, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while _metric(server, 'qconv_requests_total{status="cancelled"}') == before:
        assert time.monotonic() < deadline, "the disconnected request was never cancelled"
        time.sleep(0.1)
    assert _metric(server, "qconv_running_requests") == 0 or server.sched.active == []
    for name in (
        "qconv_generation_tokens_total",
        "qconv_decode_steps_total",
        "qconv_tokens_per_step",
        "qconv_request_latency_seconds_count",
        "qconv_time_to_first_token_seconds_count",
    ):
        assert _metric(server, name) > 0, name


def test_full_queue_is_429(tiny_qwen3):
    """A scheduler whose queue holds nothing (and never runs) turns every request into a 429."""
    from qconv.engine.loader import load_model, load_tokenizer
    from qconv.serve.scheduler import Scheduler
    from qconv.serve.server import ServerConfig, create_app

    sched = Scheduler(load_model(tiny_qwen3), load_tokenizer(tiny_qwen3), max_batch=1, max_len=64, max_queue=0)
    app = create_app(sched, ServerConfig("m", 64))
    with BackgroundServer(app, sched) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="m", prompt="hi", max_tokens=4)
        assert e.value.body["code"] == "queue_full"
