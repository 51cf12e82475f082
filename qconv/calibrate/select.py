"""Selective INT8 under a byte budget: the units whose 4-bit cost is highest per extra byte go to 8 bits.

A unit is a fused group (q/k/v, gate/up, in_proj_qkv/z) or a single projection; vLLM loads a fused layer with one
scheme, so the whole unit moves together. The units and their refusals come from the plan (qconv.convert.layout
candidate_units); refused units are recorded as such.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from qconv.calibrate.sensitivity import Candidate, Scores
from qconv.errors import QconvError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass
class Row:
    unit: str
    role: str
    modules: int
    bytes4: int
    bytes8: int
    score: float | None
    decision: str  # "int8" | "w4" | "refused: <why>"

    @property
    def extra(self) -> int:
        return self.bytes8 - self.bytes4


@dataclass
class Selection:
    budget: str
    budget_bytes: int
    scheme: str
    method: str  # how units were scored ("proxy", "kld", "random", "none")
    rows: list[Row] = field(default_factory=list)

    @property
    def spent(self) -> int:
        return sum(r.extra for r in self.rows if r.decision == "int8")

    @property
    def chosen(self) -> list[str]:
        return [r.unit for r in self.rows if r.decision == "int8"]

    @classmethod
    def from_dict(cls, d: dict) -> "Selection":
        fields = ("unit", "role", "modules", "bytes4", "bytes8", "score", "decision")
        return cls(budget=d["budget"], budget_bytes=d["budget_bytes"], scheme=d["scheme"], method=d["method"],
                   rows=[Row(**{k: r[k] for k in fields}) for r in d["units"]])

    def to_dict(self) -> dict:
        return {"budget": self.budget, "budget_bytes": self.budget_bytes, "scheme": self.scheme, "method": self.method,
                "spent_bytes": self.spent, "int8_units": len(self.chosen),
                "units": [{**asdict(r), "extra_bytes": r.extra} for r in self.rows]}


def parse_budget(spec: str, artifact_bytes: int, auto_bytes: int | None = None) -> int:
    """Bytes ("1500000000"), a size ("1.5GB", "300MiB"), a percent of the uniform-W4 artifact ("5%"), or "auto":
    `auto_bytes`, what the card has left (the caller computes it with the fit planner)."""
    if str(spec).strip() == "auto":
        if auto_bytes is None:
            raise QconvError("INT8 budget 'auto' needs the card's fit, which was not computed", where="selection.budget",
                             fix="this is a bug; pass an explicit --int8-budget meanwhile")
        return max(0, auto_bytes)
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(%|[kKMGT]i?B|B)?\s*", str(spec))
    if not m:
        raise QconvError(f"unparseable INT8 budget {spec!r}", where="selection.budget",
                         fix="use bytes (1500000000), a size (1.5GB, 300MiB) or a percent of the artifact (5%)")
    value, unit = float(m.group(1)), (m.group(2) or "")
    if value < 0:
        raise QconvError(f"negative INT8 budget {spec!r}", where="selection.budget",
                         fix="use 0 for uniform 4-bit, or a positive size / percent")
    if unit == "%":
        return int(value / 100 * artifact_bytes)
    return int(value * _UNITS[unit.lower()])


def select(units: list[Candidate], scores: Scores | None, budget_bytes: int, *, budget: str, scheme: str,
           order: list[str] | None = None) -> Selection:
    """Greedy by score per extra byte (or a given `order`, for the random baselines) until the budget is spent."""
    out = Selection(budget=budget, budget_bytes=budget_bytes, scheme=scheme,
                    method="random" if order is not None else (scores.method if scores else "none"))
    ok = [u for u in units if not u.refusal]
    if budget_bytes > 0 and units and not ok:
        detail = "; ".join(f"{u.name}: {u.refusal}" for u in units[:4])
        raise QconvError(f"INT8 budget {budget!r} cannot be spent: no candidate unit can be INT8 in vLLM ({detail})",
                         where="selection", fix="use budget 0, another selection.scheme, or other selection.candidates")
    if order is None and budget_bytes > 0 and ok:
        if scores is None:
            raise QconvError("INT8 selection needs sensitivity scores", where="selection")
        order = sorted((u.name for u in ok), key=lambda n: (-scores.values[n] / max(_extra(units, n), 1), n))
    chosen, left = set(), budget_bytes
    for name in order or []:
        extra = _extra(units, name)
        if extra <= left:
            chosen.add(name)
            left -= extra
    for u in units:
        decision = f"refused: {u.refusal}" if u.refusal else ("int8" if u.name in chosen else "w4")
        score = scores.values.get(u.name) if scores else None
        out.rows.append(Row(unit=u.name, role=u.role, modules=len(u.w4), bytes4=u.bytes4, bytes8=u.bytes8,
                            score=score, decision=decision))
    return out


def _extra(units: list[Candidate], name: str) -> int:
    u = next(u for u in units if u.name == name)
    return u.bytes8 - u.bytes4


def format_table(selection: Selection, limit: int = 40) -> str:
    """The selection table as text: most sensitive first, refused units last."""
    rows = sorted(selection.rows, key=lambda r: (r.decision.startswith("refused"), -(r.score or 0.0), r.unit))
    lines = [f"INT8 selection: budget {selection.budget} = {selection.budget_bytes / 1e6:.2f} MB, scheme "
             f"{selection.scheme}, scored by {selection.method}: {len(selection.chosen)} units, "
             f"{selection.spent / 1e6:.2f} MB spent",
             f"  {'unit':40s} {'role':12s} {'score':>11s} {'w4 MB':>8s} {'+int8 MB':>9s}  decision"]
    for r in rows[:limit]:
        score = f"{r.score:.4g}" if r.score is not None else "-"
        lines.append(f"  {r.unit:40s} {r.role:12s} {score:>11s} {r.bytes4 / 1e6:8.3f} {r.extra / 1e6:9.3f}  {r.decision}")
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more units (all in qconv.json `selection`)")
    return "\n".join(lines)
