"""vLLM's API server as qconv launches it through the plugin (qconv_vllm.frontdoor), without vLLM: the text-only door
answers an image, audio or video part with qconv's own 400 and passes everything else on untouched; the command
and environment carry qconv's connection limits and the door exactly when vLLM serves no vision."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from qconv.cli import main
from qconv.serve import vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"))
from qconv_vllm.frontdoor import TextOnly  # noqa: E402
from qconv_vllm.limits import ConnectionLimits  # noqa: E402

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _client(monkeypatch, key: str | None = None) -> TestClient:
    async def echo(request: Request):
        return JSONResponse({"inner": json.loads(await request.body())})

    if key:
        monkeypatch.setenv("VLLM_API_KEY", key)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = Starlette(
        routes=[Route("/v1/chat/completions", echo, methods=["POST"]), Route("/v1/x", echo, methods=["POST"])]
    )
    app.add_middleware(TextOnly)
    return TestClient(app)


@pytest.mark.parametrize("part", [IMAGE, {"type": "input_audio", "input_audio": {}}, {"type": "video_url"}])
def test_a_media_part_is_qconvs_400(monkeypatch, part):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    r = _client(monkeypatch).post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "text_only" and err["param"] == "messages[0].content"
    assert err["message"] == f"messages[0].content[1] is a {part['type']!r} part: this server serves text only"


def test_text_and_other_routes_pass_untouched(monkeypatch):
    c = _client(monkeypatch)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "pad": "x" * 70000,
    }
    assert c.post("/v1/chat/completions", json=body).json() == {"inner": body}  # a body longer than one chunk
    plain = {"messages": [{"role": "user", "content": [IMAGE]}]}
    assert c.post("/v1/x", json=plain).json() == {"inner": plain}  # not a chat route: not read


def test_without_the_key_the_request_goes_on_to_vllms_401(monkeypatch):
    """The door tells an unauthenticated client nothing: vLLM's own key check answers it (here: the inner app)."""
    c = _client(monkeypatch, key="sekret")
    body = {"messages": [{"role": "user", "content": [IMAGE]}]}
    assert c.post("/v1/chat/completions", json=body).json() == {"inner": body}
    r = c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "text_only"


def test_command_goes_through_the_door_when_no_vision_is_served(config_27b, tiny_models):
    src = vllm.load_source(config_27b, "3090")
    name, p = vllm.pick_profile(src, "fast")
    src.profiles = {**src.profiles, name: replace(p, language_model_only=False)}
    door = vllm.LaunchOptions(platform="cuda", frontdoor=True)
    with_vision = vllm.build_command(src, "fast", door)
    assert with_vision[1:3] == ["-m", "qconv_vllm.frontdoor"] and vllm.TEXT_ONLY not in with_vision
    cpu = vllm.build_command(src, "fast", replace(door, platform="cpu"))
    assert cpu[cpu.index("--middleware") + 1] == vllm.TEXT_ONLY  # loaded text only: the door refuses images
    text_model = vllm.load_source(tiny_models("llama"), "3090")
    assert vllm.TEXT_ONLY in vllm.build_command(text_model, None, door)
    stock = vllm.build_command(text_model, None, vllm.LaunchOptions())  # no plugin: vLLM's own server, unchanged
    assert stock[1:3] == ["-m", vllm.API_SERVER] and "--middleware" not in stock


def test_limits_reach_vllms_environment(config_27b):
    src = vllm.load_source(config_27b, "3090")
    limits = ConnectionLimits(max_connections=64, request_timeout_s=2.5)
    env, _ = vllm.launch_env(src, "fast", "cpu", 1, limits)
    assert ConnectionLimits.from_env(env) == limits
    assert not set(limits.env()) & set(vllm.launch_env(src, "fast", "cpu", 1)[0])


def test_limits_without_the_plugin_are_refused_not_dropped(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("QCONV_HOME", str(tmp_path / "home"))  # no managed runtime: no plugin known
    args = ["serve", str(tiny_models("llama")), "--recipe", "3090", "--backend", "vllm", "--print-command"]
    r = CliRunner().invoke(main, [*args, "--max-connections", "64"])
    assert r.exit_code == 2 and "--max-connections needs the qconv-vllm plugin" in r.output, r.output
    assert CliRunner().invoke(main, args).exit_code == 0
