"""The workloads of `qconv bench`, named by what the model does: copy a passage, complete code, chat, reason about
math, answer about a long passage. Each reads the small default data shipped in qconv/bench/data (licenses in its
SOURCES.md) or the user's own file in the same format."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qconv.errors import QconvError

DATA = Path(__file__).resolve().parent / "data"
COPY_INSTRUCTION = "Repeat the following text exactly, word for word.\n\n"
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{}```"
LONG_INSTRUCTION = "Read the passage below, then say who speaks last in it and sum up what they say.\n\n"
CHARS_PER_TOKEN = 3  # a long prompt's size in characters per context token (English prose is ~4: a safe margin)


@dataclass(frozen=True)
class Workload:
    name: str
    does: str  # what the model is asked to do
    file: str  # the shipped data file
    fmt: str  # what a user's file must hold


WORKLOADS = {
    w.name: w
    for w in (
        Workload("copy", "repeat a passage from the prompt", "passages.txt", "plain text (blank-line separated)"),
        Workload("code", "complete Python functions", "code.jsonl", 'jsonl with "prompt" (HumanEval)'),
        Workload("chat", "answer open questions", "chat.jsonl", 'jsonl with "turns" (MT-Bench) or "prompt"'),
        Workload("math", "reason step by step", "math.jsonl", 'jsonl with "question" (GSM8K) or "prompt"'),
        Workload("long", "answer about a passage at the context's length", "passages.txt", "plain text"),
    )
}


def parse_workloads(spec: str) -> list[str]:
    """`copy,code` -> the names, checked."""
    names = [w.strip() for w in spec.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise QconvError(
            f"unknown workload {', '.join(map(repr, bad)) or repr(spec)}",
            where="--workloads",
            fix=f"a comma-separated list of {', '.join(WORKLOADS)}",
        )
    return names


def data_files(workloads: list[str], data: tuple[str, ...]) -> dict[str, Path]:
    """Each workload's data file: the shipped one, unless --data names a folder holding `<workload>.jsonl` /
    `<workload>.txt` or gives `WORKLOAD=FILE`."""
    files = {w: DATA / WORKLOADS[w].file for w in workloads}
    for item in data:
        name, sep, value = item.partition("=")
        if sep:
            if name not in WORKLOADS:
                raise QconvError(
                    f"unknown workload {name!r}", where=f"--data {item}", fix=f"one of {', '.join(WORKLOADS)}"
                )
            path = Path(value)
            if not path.is_file():
                raise QconvError("data file not found", where=f"--data {item}", fix="give an existing file")
            files[name] = path
            continue
        folder = Path(item)
        if not folder.is_dir():
            raise QconvError(
                "no such folder",
                where=f"--data {item}",
                fix="a folder of <workload>.jsonl/.txt files, or WORKLOAD=FILE",
            )
        found = [p for w in workloads for p in (folder / f"{w}.jsonl", folder / f"{w}.txt") if p.is_file()]
        if not found:
            raise QconvError(
                f"no {' / '.join(f'{w}.jsonl' for w in workloads)} (or .txt) in this folder",
                where=f"--data {item}",
                fix="name each file after its workload, or pass WORKLOAD=FILE",
            )
        files.update({p.stem: p for p in found})
    return files


def jsonl_field(path: Path, fields: tuple[str, ...], n: int) -> list:
    """The first of `fields` each row has, for the first n rows (one clear error for a row that has none)."""
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(next(row[f] for f in fields if f in row))
        except (json.JSONDecodeError, StopIteration, TypeError) as e:
            raise QconvError(
                f"line {i + 1} is not a JSON object with a {' or '.join(map(repr, fields))} field",
                where=str(path),
                fix="pass a jsonl file in the format this workload reads (docs/BENCH.md)",
            ) from e
        if len(out) == n:
            break
    return out


_HEADING = re.compile(r"^(=+) .* \1$")  # wikitext's "= Title =", "= = Section = ="


def paragraphs(text: str, long_line: int = 200) -> list[str]:
    """One per line in a file whose lines are longer than wrapped text has (wikitext), else blank-line separated
    blocks with their wrapped lines joined; headings dropped."""
    lines = [ln.strip() for ln in text.splitlines()]
    if any(len(ln) > long_line for ln in lines):
        return [ln for ln in lines if ln and not _HEADING.match(ln)]
    blocks = re.split(r"\n[ \t]*\n", text)
    return [
        " ".join(ln.strip() for ln in b.splitlines() if ln.strip() and not _HEADING.match(ln.strip())) for b in blocks
    ]


def passages(text: str, n: int, min_chars: int = 400, max_chars: int = 900) -> list[str]:
    """The paragraphs of at least `min_chars`, each cut at a sentence end within `max_chars`."""
    out = []
    for para in paragraphs(text):
        if len(para) < min_chars:
            continue
        cut = para[:max_chars]
        end = cut.rfind(". ")
        out.append(cut[: end + 1] if end > min_chars // 2 else cut)
        if len(out) == n:
            break
    return out


def texts(workload: str, path: Path, n: int, context_tokens: int = 0) -> list[str]:
    """The n user messages of a workload from its data file. `long` fills `context_tokens` (about) with the
    passage, each prompt starting further into the text."""
    if workload == "copy":
        out = [COPY_INSTRUCTION + p for p in passages(path.read_text(errors="replace"), n)]
    elif workload == "long":
        body = "\n\n".join(paragraphs(path.read_text(errors="replace")))
        size = max(context_tokens, 256) * CHARS_PER_TOKEN
        step = max((len(body) - size) // max(n, 1), 0)
        out = [LONG_INSTRUCTION + body[i * step : i * step + size] for i in range(n)] if len(body) > 200 else []
    elif workload == "code":
        out = [CODE_INSTRUCTION.format(p) for p in jsonl_field(path, ("prompt",), n)]
    elif workload == "chat":
        out = [t[0] if isinstance(t, list) else t for t in jsonl_field(path, ("turns", "prompt"), n)]
    else:
        out = jsonl_field(path, ("question", "prompt"), n)
    if not out or not all(isinstance(t, str) and t for t in out):
        raise QconvError(
            f"no {workload} prompts in this file",
            where=str(path),
            fix=f"the {workload} workload reads {WORKLOADS[workload].fmt}",
        )
    return out
