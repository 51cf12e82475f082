"""Selective upgrades under a byte budget: the units whose 4-bit cost is highest per extra byte go to 8 bits, or
to one of the selection's cheaper steps (smaller int4 groups) where that buys more per byte.

A unit is a fused group (q/k/v, gate/up, in_proj_qkv/z) or a single projection; vLLM loads a fused layer with one
scheme, so the whole unit moves together. The units and their refusals come from the plan (qconv.convert.layout
candidate_units); refused units are recorded as such.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from qconv.calibrate.sensitivity import BASE, Scores
from qconv.calibrate.units import Unit
from qconv.errors import QconvError
from qconv.manifest import UPGRADE, SelectionRow
from qconv.recipes.schema import renamed

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass
class Row(SelectionRow):
    @property
    def extra(self) -> int:
        return self.top_bytes - self.base_bytes

    @property
    def upgraded(self) -> bool:
        return self.decision != "w4" and not self.decision.startswith("refused")

    @property
    def spent(self) -> int:
        if not self.upgraded:
            return 0
        return (self.chosen_bytes if self.chosen_bytes is not None else self.top_bytes) - self.base_bytes


@dataclass
class Selection:
    budget: str
    budget_bytes: int
    scheme: str
    method: str  # how units were scored ("proxy", "kld", "random", "none")
    rows: list[Row] = field(default_factory=list)
    # proxy only: ½ Σ units' F-weighted rounding error under their decisions; recorded in qconv.json, never printed
    # as a KLD (it ignores GPTQ's compensation: 2.7x to 5x the measured KLD on SmolLM2)
    predicted_kld: float | None = None

    @property
    def spent(self) -> int:
        return sum(r.spent for r in self.rows)

    @property
    def chosen(self) -> list[str]:
        """The units moved to the selection's top scheme."""
        return [r.unit for r in self.rows if r.decision == UPGRADE]

    @property
    def choices(self) -> dict[str, str]:
        """Every upgraded unit -> the recipe scheme it takes (qconv.convert.layout.apply_selection)."""
        return {r.unit: self.scheme if r.decision == UPGRADE else r.decision for r in self.rows if r.upgraded}

    @classmethod
    def from_dict(cls, d: dict) -> Selection:
        keys = {f.name for f in fields(Row)}
        return cls(
            budget=d["budget"],
            budget_bytes=d["budget_bytes"],
            scheme=d["scheme"],
            method=d["method"],
            rows=[Row(**{k: v for k, v in renamed(Row, r).items() if k in keys}) for r in d["units"]],
            predicted_kld=d.get("predicted_kld"),
        )

    def to_dict(self) -> dict:
        steps = Counter(r.decision for r in self.rows if r.upgraded and r.decision != UPGRADE)
        return {
            "budget": self.budget,
            "budget_bytes": self.budget_bytes,
            "scheme": self.scheme,
            "method": self.method,
            "spent_bytes": self.spent,
            "int8_units": len(self.chosen),  # the upgrades' count, under its qconv.json name
            "step_units": dict(steps),
            "predicted_kld": self.predicted_kld,
            "units": [{**asdict(r), "extra_bytes": r.extra} for r in self.rows],
        }


def parse_budget(spec: str, artifact_bytes: int, auto_bytes: int | None = None) -> int:
    """Bytes ("1500000000"), a size ("1.5GB", "300MiB"), a percent of the uniform-W4 artifact ("5%"), or "auto":
    `auto_bytes`, what the card has left (the caller computes it with the fit planner)."""
    if str(spec).strip() == "auto":
        if auto_bytes is None:
            raise QconvError(
                "upgrade budget 'auto' needs the card's fit, which was not computed",
                where="selection.budget",
                fix="this is a bug; pass an explicit --int8-budget meanwhile",
            )
        return max(0, auto_bytes)
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(%|[kKMGT]i?B|B)?\s*", str(spec))
    if not m:
        raise QconvError(
            f"unparseable upgrade budget {spec!r}",
            where="selection.budget",
            fix="use bytes (1500000000), a size (1.5GB, 300MiB) or a percent of the artifact (5%)",
        )
    value, unit = float(m.group(1)), (m.group(2) or "")
    if value < 0:
        raise QconvError(
            f"negative upgrade budget {spec!r}",
            where="selection.budget",
            fix="use 0 for uniform 4-bit, or a positive size / percent",
        )
    if unit == "%":
        return int(value / 100 * artifact_bytes)
    return int(value * _UNITS[unit.lower()])


def select(
    units: list[Unit],
    scores: Scores | None,
    budget_bytes: int,
    *,
    budget: str,
    scheme: str,
    order: list[str] | None = None,
) -> Selection:
    """Greedy by gain per extra byte until the budget is spent: each step takes, over all units, the upgrade (from a
    unit's current scheme to a costlier one of its options) with the best marginal gain per byte that still fits.
    With one option per unit this is the plain score-per-byte order. A given `order` (the random baselines) moves
    units to the 8-bit scheme in that order instead."""
    out = Selection(
        budget=budget,
        budget_bytes=budget_bytes,
        scheme=scheme,
        method="random" if order is not None else (scores.method if scores else "none"),
    )
    ok = [u for u in units if not u.refusal or any(not o.refusal for o in u.options)]
    if budget_bytes > 0 and units and not ok:
        detail = "; ".join(f"{u.name}: {u.refusal}" for u in units[:4])
        raise QconvError(
            f"upgrade budget {budget!r} cannot be spent: no candidate unit can take the selection's scheme in vLLM ({detail})",
            where="selection",
            fix="use budget 0, another selection.scheme, or other selection.candidates",
        )
    if order is None and budget_bytes > 0 and ok and scores is None:
        raise QconvError("the upgrade selection needs sensitivity scores", where="selection")
    level: dict[str, tuple[str, int, float]] = {}  # unit -> (scheme, extra bytes, gain)
    if order is not None:
        left = budget_bytes
        for name in order:
            u = next(u for u in units if u.name == name)
            if not u.refusal and u.top_bytes - u.base_bytes <= left:
                level[name] = (scheme, u.top_bytes - u.base_bytes, 0.0)
                left -= u.top_bytes - u.base_bytes
    elif budget_bytes > 0:
        level = _greedy(ok, scores, budget_bytes, scheme)
    for u in units:
        score = scores.values.get(u.name) if scores else None
        chosen, extra, _ = level.get(u.name, ("", 0, 0.0))
        if chosen:
            decision = UPGRADE if chosen == scheme else chosen
        else:
            decision = f"refused: {u.refusal}" if u.refusal else "w4"
        out.rows.append(
            Row(
                unit=u.name,
                role=u.role,
                modules=len(u.base),
                base_bytes=u.base_bytes,
                top_bytes=u.top_bytes,
                score=score,
                decision=decision,
                chosen_bytes=u.base_bytes + extra if chosen else None,
            )
        )
    if scores is not None and scores.errors and all(u.name in scores.errors for u in units):
        out.predicted_kld = 0.5 * sum(scores.errors[u.name][level.get(u.name, (BASE,))[0] or BASE] for u in units)
    return out


def _greedy(units: list[Unit], scores: Scores, budget: int, top: str) -> dict[str, tuple[str, int, float]]:
    level: dict[str, tuple[str, int, float]] = {}
    left = budget
    while True:
        best = None
        for u in units:
            _, cur_extra, cur_gain = level.get(u.name, ("", 0, 0.0))
            for o in u.options:
                gain, extra = scores.gain(u.name, o.scheme, top), o.bytes - u.base_bytes
                if o.refusal or gain is None or extra <= cur_extra or extra - cur_extra > left:
                    continue
                if u.name in level and gain <= cur_gain:
                    continue  # costlier and no better than what the unit already has
                key = ((gain - cur_gain) / (extra - cur_extra), u.name)
                if best is None or key[0] > best[0][0] or (key[0] == best[0][0] and key[1] < best[0][1]):
                    best = (key, u.name, o.scheme, extra, gain)
        if best is None:
            return level
        _, name, chosen, extra, gain = best
        left -= extra - level.get(name, ("", 0, 0.0))[1]
        level[name] = (chosen, extra, gain)


def format_table(selection: Selection, limit: int = 40) -> str:
    """The selection table as text: most sensitive first, refused units last."""
    rows = sorted(selection.rows, key=lambda r: (r.decision.startswith("refused"), -(r.score or 0.0), r.unit))
    steps = len(selection.choices) - len(selection.chosen)
    lines = [
        f"upgrade selection: budget {selection.budget} = {selection.budget_bytes / 1e6:.2f} MB, scheme "
        f"{selection.scheme}, scored by {selection.method}: {len(selection.chosen)} units"
        + (f" + {steps} at a cheaper step" if steps else "")
        + f", {selection.spent / 1e6:.2f} MB spent",
        f"  {'unit':40s} {'role':12s} {'score':>11s} {'w4 MB':>8s} {'+top MB':>9s}  decision",
    ]
    for r in rows[:limit]:
        score = f"{r.score:.4g}" if r.score is not None else "-"
        lines.append(
            f"  {r.unit:40s} {r.role:12s} {score:>11s} {r.base_bytes / 1e6:8.3f} {r.extra / 1e6:9.3f}  {r.decision}"
        )
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more units (all in qconv.json `selection`)")
    return "\n".join(lines)
