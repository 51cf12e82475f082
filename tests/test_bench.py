"""`qconv bench`: workloads and their data, the spec-decode counters of both servers, the typed bench.json, the
CLI's errors on bad input, and tokens per verify step equal to the engine's own count for the same requests."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from qconv.bench import counters, workloads
from qconv.bench.schema import load
from qconv.errors import QconvError
from tests.cli_helpers import run

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
"""


def test_vllm_counters_give_vllm_bench_serves_acceptance_length():
    before = counters.parse(VLLM_METRICS.replace(" 10.0", " 4.0").replace(" 25.0", " 10.0"))
    d = counters.parse(VLLM_METRICS) - before
    assert (d.source, d.drafts, d.accepted) == ("vllm", 6, 15)
    assert d.acceptance_length == 1 + 15 / 6  # vllm bench serve: 1 + accepted / drafts
    assert counters.parse(VLLM_METRICS).per_position() == [0.9, 0.7]
    assert counters.parse("# nothing\n").acceptance_length is None  # no speculation: no number, not 1.0


def test_workloads_ship_their_data_and_read_user_files(tmp_path):
    files = workloads.data_files(list(workloads.WORKLOADS), ())
    for w, f in files.items():
        assert f.is_file() and len(workloads.texts(w, f, 8, 2048)) == 8, w
    assert (workloads.DATA / "SOURCES.md").read_text().count("|") > 20  # each file's source and license
    long = workloads.texts("long", files["long"], 2, 1000)
    assert 2500 < len(long[0]) < 3200 and long[0] != long[1]
    (tmp_path / "chat.jsonl").write_text('{"prompt": "Hi?"}\n{"prompt": "Why?"}\n')
    mine = workloads.data_files(["chat", "code"], (str(tmp_path),))
    assert mine["chat"] == tmp_path / "chat.jsonl" and mine["code"] == files["code"]
    assert workloads.texts("chat", mine["chat"], 5) == ["Hi?", "Why?"]
    with pytest.raises(QconvError, match="unknown workload 'poetry'"):
        workloads.parse_workloads("copy,poetry")
    (tmp_path / "code.jsonl").write_text('{"question": "no prompt here"}\n')
    with pytest.raises(QconvError, match="'prompt' field"):
        workloads.texts("code", tmp_path / "code.jsonl", 2)


def _bench(*args):
    return run("bench", *args)


def test_cli_refuses_bad_input_with_one_error_before_starting_anything(tmp_path, tiny_llama):
    out = tmp_path / "out"
    r = _bench(tiny_llama, "--workloads", "copy,poetry", "--out", out)
    assert r.exit_code != 0 and "unknown workload 'poetry'" in r.output and "--workloads" in r.output
    bad = tmp_path / "math.jsonl"
    bad.write_text("this is not json\n")
    r = _bench(tiny_llama, "--workloads", "math", "--data", f"math={bad}", "--out", out)
    assert r.exit_code != 0 and "line 1 is not a JSON object" in r.output and str(bad) in r.output
    r = _bench(tiny_llama, "--concurrency", "0,x", "--out", out)
    assert r.exit_code != 0 and "--concurrency" in r.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _bench(tiny_llama, "--port", port, "--out", out)
        assert r.exit_code != 0 and f"port {port} on 127.0.0.1 is in use" in r.output
        r = _bench("--url", f"http://127.0.0.1:{port}", "--out", out)  # listens, never answers
    assert r.exit_code != 0 and "no OpenAI-compatible server answers" in r.output and "--url" in r.output
    r = _bench(tiny_llama, "--compare", "no-such-profile", "--out", out)
    assert r.exit_code != 0 and "neither an artifact folder nor a profile" in r.output
    assert not out.exists()  # nothing written


def test_bench_json_is_typed_and_checked_on_load(tmp_path):
    from qconv.bench.client import RequestResult
    from qconv.bench.schema import BenchReport, Cell, Target, WorkloadInfo

    res = [RequestResult(10, 5, 0.1, [0.01] * 4, 0.2), RequestResult(10, 0, error="HTTPError: 500")]
    cell = Cell.measure("a", "chat", 2, res, 0.5, counters.SpecCounters("qconv", 2, 6, 3))
    assert (cell.completed, cell.failed, cell.output_throughput, cell.spec_decode_acceptance_length) == (1, 1, 10, 2.5)
    assert cell.tpot_ms.median == pytest.approx(25.0) and cell.errors == ["HTTPError: 500"]
    rep = BenchReport(
        "d",
        "v",
        "qconv bench",
        {"cpu": "x"},
        16,
        {"chat": WorkloadInfo("chat", "f", 2)},
        [Target("a", "u", "m", 64)],
        [cell],
    )
    path = rep.save(tmp_path)
    assert load(path) == rep
    data = json.loads(path.read_text())
    data["cells"][0]["output_throughput"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(QconvError, match="malformed bench report.*output_throughput"):
        load(path)


def test_tokens_per_step_is_the_engines_own_count(tiny_llama, tmp_path, one_thread):
    """The bench's tokens per verify step, read from the server's counters, equals the count the engine keeps for the
    same prompts decoded one at a time (generate_tokens' statistics); greedy output with speculation equals output
    without it."""
    from dataclasses import replace

    from qconv.bench import runner
    from qconv.engine.generate import GenerationConfig, GenerationStats, encode_prompt, generate_tokens
    from qconv.engine.loader import load_model, load_tokenizer
    from qconv.engine.spec import SpecConfig
    from qconv.serve.scheduler import Scheduler
    from qconv.serve.server import ServerConfig, create_app
    from tests.serve_helpers import BackgroundServer

    model, tok = load_model(tiny_llama), load_tokenizer(tiny_llama)
    spec = SpecConfig("lookup", max_block=6)
    sched = Scheduler(model, tok, max_batch=2, max_len=1024, max_queue=8, spec=spec).start()
    side = runner.Side("tiny", url="")
    data = workloads.data_files(["copy", "code"], ())
    plan = runner.Plan([side], ["copy", "code"], [1], 2, 24, data, tmp_path)
    lines: list[str] = []
    with BackgroundServer(create_app(sched, ServerConfig("tiny", 1024)), sched) as srv:
        side.url = srv.base_url
        report = runner.run(plan, runner.Console(lines.append))
    cfg = GenerationConfig(max_tokens=24, spec=spec)
    for w in ("copy", "code"):
        stats, plain = GenerationStats(), GenerationStats()
        for text in workloads.texts(w, data[w], 2):
            ids = encode_prompt(tok, text, chat=True)
            out = list(generate_tokens(model, ids, cfg, stats))
            assert out == list(generate_tokens(model, ids, replace(cfg, spec=SpecConfig("none")), plain))
        cell = report.cell("tiny", w, 1)
        assert cell is not None and cell.completed == 2 and cell.spec_decode_source == "qconv"
        assert cell.total_output_tokens == stats.new_tokens
        assert (cell.spec_decode_num_drafts, cell.spec_decode_accepted_tokens) == (
            stats.drafted[0],
            sum(stats.accepted),
        )
        assert cell.spec_decode_acceptance_length == round(1 + sum(stats.accepted) / stats.drafted[0], 4) > 1
    assert any("copy at concurrency 1" in ln for ln in lines)  # progress on the console


def test_cli_compare_starts_both_servers_and_writes_every_output(tiny_llama, tmp_path):
    """`qconv bench ART --compare spec-tokens=0`: two `qconv serve` processes, the cells taken turn about, then the
    table, bench.json, bench.md and a chart per workload; the servers are gone afterwards."""
    out = tmp_path / "out"
    r = _bench(
        tiny_llama, "--backend", "native", "--workloads", "chat", "--concurrency", "1,2", "--prompts", "2",
        "--max-tokens", "8", "--spec-tokens", "4", "--compare", "spec-tokens=0", "--out", out, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = load(out / "bench.json")
    assert [t.label for t in rep.targets] == ["spec-tokens=4", "spec-tokens=0"] and rep.interleaved
    assert [(c.concurrency, c.target) for c in rep.cells] == [
        (1, "spec-tokens=4"), (1, "spec-tokens=0"), (2, "spec-tokens=0"), (2, "spec-tokens=4")
    ]  # fmt: skip
    assert all(c.completed == 2 and c.total_output_tokens > 0 for c in rep.cells)
    assert rep.cell("spec-tokens=0", "chat", 1).spec_decode_acceptance_length is None  # nothing drafted
    assert rep.targets[1].serve_command[-2:] == ["--spec-tokens", "0"]
    md = (out / "bench.md").read_text()
    assert "| chat | 2 | spec-tokens=0 |" in md and "![bench-chat](bench-chat.png)" in md
    assert (out / "bench-chat.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads(r.stdout[r.stdout.index("{") :])["schema_version"] == 1
    for t in rep.targets:  # stopped: nothing answers there any more
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(t.url.rsplit(":", 1)[1])), timeout=2):
            pass


def test_cli_compare_two_artifacts_interleaved(tiny_llama, tiny_qwen3, tmp_path):
    """`qconv bench ART --compare ART2`: each artifact served by its own `qconv serve`, named by its folder, the cells
    taken turn about."""
    out = tmp_path / "out"
    r = _bench(
        tiny_llama, "--backend", "native", "--workloads", "code", "--concurrency", "1", "--prompts", "2",
        "--max-tokens", "6", "--compare", tiny_qwen3, "--out", out,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = load(out / "bench.json")
    assert [t.label for t in rep.targets] == [tiny_llama.name, tiny_qwen3.name] and rep.interleaved
    assert [t.serve_command[t.serve_command.index("serve") + 1] for t in rep.targets] == [
        str(tiny_llama), str(tiny_qwen3)
    ]  # fmt: skip
    assert sorted(c.target for c in rep.cells) == sorted([tiny_llama.name, tiny_qwen3.name])
    assert all(c.completed == 2 and c.total_output_tokens > 0 for c in rep.cells)


def test_native_device_choice(monkeypatch):
    """`qconv serve/bench --device`: auto takes CUDA when torch sees it; cuda without one is one clear error."""
    import torch

    from qconv.serve.native import engine_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device("auto") == "cpu" and engine_device("cpu") == "cpu"
    with pytest.raises(QconvError, match="no CUDA device"):
        engine_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_device("auto") == "cuda"


def test_compare_records_the_profile_each_side_serves(tmp_path):
    """`qconv bench ART --compare ART2`: with no --profile, each `qconv serve` runs its artifact's default profile,
    and that is what each side names (bench.json's `profile`), the second side included."""
    from qconv.artifact import Artifact
    from qconv.bench.commands import _sides
    from tests.test_serve_vllm_plugin import tiny_artifact

    art, _ = tiny_artifact(tmp_path, "qwen3_5_wide", "3090")
    other = tmp_path / "other"
    shutil.copytree(art, other)
    default = Artifact.find(art).default_profile
    assert default
    sides = _sides(str(art), None, str(other), "native", None, {}, [], [])
    assert [s.profile for s in sides] == [default, default]
    assert [s.serve_args[s.serve_args.index("--profile") + 1] for s in sides] == [default, default]
    named = next(p for p in Artifact.find(art).profiles if p != default)  # a named profile both artifacts have
    assert [s.profile for s in _sides(str(art), None, str(other), "native", named, {}, [], [])] == [named, named]


def test_compare_compute_dtype_changes_only_that_option(tiny_llama):
    """`--compare compute-dtype=bfloat16`: the same artifact and profile served twice, the second side with
    `qconv serve --compute-dtype bfloat16` and nothing else changed; the first side's own choice cannot be compared
    with itself."""
    from qconv.bench.commands import _sides

    a, b = _sides(str(tiny_llama), None, "compute-dtype=bfloat16", "vllm", "fast", {}, [], ["--enforce-eager"])
    assert (a.label, b.label) == ("compute-dtype=auto", "compute-dtype=bfloat16")
    assert "--compute-dtype" not in a.serve_args
    i = b.serve_args.index("--compute-dtype")
    assert b.serve_args[i : i + 2] == ["--compute-dtype", "bfloat16"]
    assert b.serve_args[:i] + b.serve_args[i + 2 :] == a.serve_args and a.serve_args[-2:] == ["--", "--enforce-eager"]
    over = {"spec-tokens": "0", "compute-dtype": "float32"}
    a, b = _sides(str(tiny_llama), None, "compute-dtype=bfloat16", "vllm", "fast", over, [], [])
    assert a.label == "compute-dtype=float32" and b.serve_args.count("--spec-tokens") == 1
    for bad in ("compute-dtype=auto", "compute-dtype=half"):
        with pytest.raises(QconvError, match="other than the first side's"):
            _sides(str(tiny_llama), None, bad, "vllm", "fast", {}, [], [])
    r = run("bench", tiny_llama, "--compute-dtype", "half")
    assert r.exit_code != 0 and "--compute-dtype" in r.output
