"""Issue 30.9: one build does each piece of work once (the recipe parsed, the source's config.json read, --out
checked, each artifact file hashed, its qconv.json read back for the summary), writes report.json without reading
it back, and `qconv serve` opens the artifact's qconv.json once. Counted by wrapping the readers."""

from __future__ import annotations

import pathlib
from collections import Counter
from pathlib import Path

from tests.cli_helpers import FAST_CAL, build, run


def _counting(monkeypatch, module, name: str, counts: Counter, key=lambda *a, **k: None):
    real = getattr(module, name)

    def wrapper(*a, **k):
        counts[(name, key(*a, **k))] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapper)


def test_a_build_does_each_thing_once_and_serve_reads_its_manifest_once(tiny_llama, tmp_path, calib_txt, monkeypatch):
    import qconv.convert.finish
    import qconv.convert.sources
    import qconv.fsutil
    from qconv import artifact
    from qconv.build import options, pipeline
    from tests.tiny import CORPUS

    held_out = tmp_path / "held_out.txt"
    held_out.write_text(CORPUS[::-1] * 30)
    out, counts = tmp_path / "out", Counter()
    _counting(monkeypatch, options, "load_recipe", counts)
    _counting(monkeypatch, pipeline, "check_out", counts)
    _counting(monkeypatch, pathlib.Path, "read_text", counts, key=lambda self, *a, **k: str(self))
    _counting(monkeypatch, qconv.convert.sources, "read_config", counts, key=lambda folder: str(Path(folder).resolve()))
    for mod in (qconv.fsutil, qconv.convert.finish):
        _counting(monkeypatch, mod, "sha256_file", counts, key=lambda p: str(p))

    r = build(
        "3090",
        tiny_llama,
        out,
        "--dataset",
        calib_txt,
        "--work-dir",
        tmp_path / "work",
        "--eval-text",
        held_out,
        "--no-gates",
        *FAST_CAL,
    )
    assert r.exit_code == 0, r.output
    assert counts[("load_recipe", None)] == 1
    assert counts[("check_out", None)] == 1
    # the build's reader (the quality stage's transformers load of the source, when its reference log-probs are not
    # cached yet, reads it on its own)
    assert counts[("read_config", str(Path(tiny_llama).resolve()))] == 1
    reads = {Path(p).name: n for (what, p), n in counts.items() if what == "read_text" and Path(p).parent == out}
    assert reads == {"qconv.json": 1}, reads  # the summary's; report.json is written once and never read back
    hashed = Counter(
        Path(p).name
        for (what, p), n in counts.items()
        for _ in range(n)
        if what == "sha256_file" and Path(p).parent.parent == tmp_path and Path(p).parent.name.startswith(".")
    )
    assert hashed and set(hashed.values()) == {1}, hashed  # every file of the artifact hashed once
    assert {"model.safetensors", "report.json", "config.json"} <= set(hashed)

    import uvicorn

    from qconv.serve import runtimes

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)  # build the server, do not serve
    monkeypatch.setattr(runtimes, "find_runtime", lambda *a, **k: None)  # no vLLM here: auto picks our engine
    _counting(monkeypatch, artifact, "read_manifest", counts, key=lambda path: "serve")
    r = run("serve", out, "--port", "0")  # --backend auto: reads `requires`, then serves
    assert r.exit_code == 0 and "backend: native" in r.output, r.output
    assert counts[("read_manifest", "serve")] == 1


def test_upgrade_budget_is_the_option_and_int8_budget_its_alias():
    """30.11: the budget buys int4 g64/g32 steps as well as INT8, so the option says `upgrade`; the old name is the
    same option (last one wins) and the help says it is an alias."""
    from click.testing import CliRunner

    from qconv.build.commands import build

    help_text = CliRunner().invoke(build, ["--help"], terminal_width=200).output
    assert "--upgrade-budget, --int8-budget" in help_text and "old name, kept as an alias" in " ".join(
        help_text.split()
    )
    opt = next(p for p in build.params if p.name == "upgrade_budget")
    assert opt.opts == ["--upgrade-budget", "--int8-budget"]
