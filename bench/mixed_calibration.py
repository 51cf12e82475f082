"""A general-domain calibration text for the SmolLM2 quality tables: HumanEval's prompts and solutions and MT-Bench's
questions (code and chat, shuffled with a fixed seed), then the first 400,000 characters of tiny shakespeare. Never
WikiText or GSM8K, the texts the tables score. Writes OUT and prints one JSON line.

    .venv/bin/python bench/mixed_calibration.py /work/runs/mixed_cal.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SHAKESPEARE_CHARS = 400_000


def mixed_text(data: Path = DATA) -> str:
    parts = []
    for line in (data / "humaneval.jsonl").read_text().splitlines():
        r = json.loads(line)
        parts.append(r["prompt"] + r.get("canonical_solution", ""))
    for line in (data / "mt_bench_questions.jsonl").read_text().splitlines():
        parts.extend(json.loads(line).get("turns", []))
    random.Random(0).shuffle(parts)
    return "\n\n".join(parts) + "\n\n" + (data / "tinyshakespeare.txt").read_text()[:SHAKESPEARE_CHARS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    text = mixed_text()
    args.out.write_text(text)
    print(json.dumps({"out": str(args.out), "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}))


if __name__ == "__main__":
    main()
