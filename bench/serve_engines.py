"""Both serving engines on one artifact, on this host: `qconv serve ART --backend native` and `--backend vllm`, the
same chat prompts through the OpenAI client, greedy, one client and then `--clients` at once; and which one
`--backend auto` picks here. Prints one JSON line.

    QCONV_HOME=.cache/qconv_home .venv/bin/python bench/serve_engines.py ART [--prompts 8] [--max-tokens 64]
        [--clients 4] [--profile P] [--max-batch N] [-- VLLM_ARGS...]

vLLM comes from the runtime `qconv runtime install` recorded under QCONV_HOME (the one `qconv serve` would use).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_load import PROMPTS  # noqa: E402  (bench/ is on sys.path: this script runs as bench/serve_engines.py)


def measure(art: Path, backend: str, extra: list[str], prompts: list[str], max_tokens: int, clients: int) -> dict:
    import openai

    from tests.serve_helpers import ServerProcess, free_port, run_load

    with ServerProcess([str(art), "--backend", backend, *extra], free_port(), health_timeout=1200) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        run_load(client, name, prompts[:1], 1, 8)  # warm-up
        one = run_load(client, name, prompts, 1, max_tokens)
        many = run_load(client, name, prompts, clients, max_tokens)
    return {
        "single_tok_s": round(one.tokens_per_s, 2),
        f"c{clients}_tok_s": round(many.tokens_per_s, 2),
        "tokens": one.tokens,
        "texts": [r.text for r in one.results],
    }


def auto_choice(art: Path, profile: str | None) -> dict:
    """What `qconv serve ART --backend auto` decides on this host, without starting it."""
    from qconv.artifact import Artifact
    from qconv.serve import runtimes
    from qconv.serve.commands import _cuda_gpu

    a = Artifact.open(art)
    c = runtimes.choose_backend(a.requires, profile or a.default_profile, runtimes.find_runtime(), _cuda_gpu())
    return {"backend": c.backend, "reason": c.reason}


def main() -> None:
    argv = sys.argv[1:]
    vllm_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--max-batch", type=int, default=None, help="both engines' --max-batch (default: their own)")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    prompts = PROMPTS[: a.prompts]
    common = (["--profile", a.profile] if a.profile else []) + (
        ["--max-batch", str(a.max_batch)] if a.max_batch else []
    )
    out: dict = {"bench": "serve_engines", "artifact": a.artifact.name, "profile": a.profile or "default"}
    out["max_batch"] = a.max_batch or "default"
    out["auto"] = auto_choice(a.artifact, a.profile)
    for backend, extra in (("native", common), ("vllm", [*common, "--", *vllm_args] if vllm_args else common)):
        t = time.monotonic()
        out[backend] = measure(a.artifact, backend, extra, prompts, a.max_tokens, a.clients)
        out[backend]["wall_s"] = round(time.monotonic() - t, 1)
    key = f"c{a.clients}_tok_s"
    out["faster"] = {
        k: max(("native", "vllm"), key=lambda b: out[b][k]) for k in ("single_tok_s", key)
    }  # per load, the faster engine
    out["same_greedy_text"] = sum(x == y for x, y in zip(out["native"]["texts"], out["vllm"]["texts"]))
    for b in ("native", "vllm"):
        out[b].pop("texts")
    out.update(prompts=len(prompts), max_tokens=a.max_tokens, clients=a.clients, date=time.strftime("%Y-%m-%d"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
