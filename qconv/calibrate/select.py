"""Selective INT8 under a byte budget: the units whose 4-bit cost is highest per extra byte go to 8 bits.

A unit is a fused group (q/k/v, gate/up, in_proj_qkv/z) or a single projection; vLLM loads a fused layer with one
scheme, so the whole unit moves together. Units vLLM could not run at 8 bits are refused and recorded as such.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from qconv.calibrate.sensitivity import Scores, Unit
from qconv.convert.layout import MARLIN_MIN_K, MARLIN_MIN_N, Plan, decide
from qconv.errors import QconvError
from qconv.manifest import ModuleDecision
from qconv.recipes.recipe import KEEP, Recipe
from qconv.recipes.roles import FUSED

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# vLLM's int8 GEMM (cutlass scaled_mm) needs 16-aligned K and N for W8A8.
CUTLASS_ALIGN = 16


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


def bpw_budget(bpw: float, plan: Plan) -> int:
    """The bytes a bits-per-weight target leaves for 8-bit upgrades over the recipe's plan, counted as the quality
    report counts bpw (artifact tensor bytes x 8 / source parameters)."""
    base = 8 * plan.total_bytes / max(plan.num_parameters, 1)
    if bpw <= 0 or bpw < base - 1e-9:
        raise QconvError(f"bits-per-weight target {bpw} is below the recipe's uniform plan ({base:.3f} bpw)",
                         where="--bpw", fix=f"use --bpw >= {base:.2f}, or a recipe with smaller schemes")
    return int(bpw * plan.num_parameters / 8) - plan.total_bytes


def int8_refusal(role: str, w8: list[ModuleDecision], recipe: Recipe, scheme: str) -> str:
    """Why vLLM could not run this unit at 8 bits ("" if it can). On Ampere with bf16 activations the only W8A16
    kernel is Marlin (Exllama is fp16-only, the Triton/Conch paths are 4-bit), so its shape limits are hard here;
    W8A8 goes through cutlass scaled_mm."""
    kept = [m for m in w8 if m.scheme == KEEP]
    if kept:
        return kept[0].note or "no group size fits"
    k = w8[0].shape[1]
    n = sum(m.shape[0] for m in w8) if role in FUSED else w8[0].shape[0]
    if recipe.schemes[scheme].activations:
        if k % CUTLASS_ALIGN or n % CUTLASS_ALIGN:
            return f"cutlass int8 needs in%{CUTLASS_ALIGN}==0 and out%{CUTLASS_ALIGN}==0 (in {k}, out {n})"
        return ""
    if k % MARLIN_MIN_K or n % MARLIN_MIN_N:
        return f"W8A16 needs Marlin: in%{MARLIN_MIN_K}==0 and out%{MARLIN_MIN_N}==0 (in {k}, out {n})"
    return ""


def candidate_units(plan: Plan, recipe: Recipe) -> list[Unit]:
    """The recipe's candidate roles as units, with their 8-bit decisions and any refusal."""
    sel = recipe.selection
    s8 = recipe.schemes[sel.scheme]
    units = []
    for name, members in plan.units().items():
        role = members[0].role
        if role not in sel.candidates:
            continue
        if any(m.scheme == KEEP or (m.bits or 16) >= s8.weights.bits for m in members):
            if recipe.scheme_for(role) == KEEP:
                raise QconvError(f"INT8 candidate role {role!r} is kept bf16 by the recipe", where="selection.candidates",
                                 fix=f"selection upgrades 4-bit units only: drop {role} from selection.candidates")
            continue  # a member the plan already keeps (no group size fits): nothing to upgrade
        w8 = [decide(m.name, m.role, tuple(m.shape), sel.scheme, s8, recipe)[0] for m in members]
        units.append(Unit(name=name, role=role, w4=members, w8=w8, refusal=int8_refusal(role, w8, recipe, sel.scheme)))
    return units


def select(units: list[Unit], scores: Scores | None, budget_bytes: int, *, budget: str, scheme: str,
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


def _extra(units: list[Unit], name: str) -> int:
    u = next(u for u in units if u.name == name)
    return u.bytes8 - u.bytes4


def apply_selection(plan: Plan, units: list[Unit], selection: Selection) -> list[ModuleDecision]:
    """The plan's modules with the chosen units' members switched to their 8-bit decisions."""
    chosen = set(selection.chosen)
    repl = {m.name: m for u in units if u.name in chosen for m in u.w8}
    return [repl.get(m.name, m) for m in plan.modules]


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
