"""What the selection chooses among: a unit (a fused group or one projection of the plan) and the schemes it can
be upgraded to, with their sizes in the artifact. The plan (qconv.convert.layout) makes them; sensitivity scores
them and select picks (this package)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qconv.manifest import ModuleDecision

__all__ = ["Option", "Unit", "module_bytes"]


def module_bytes(m: ModuleDecision, scheme_bits: int | None = None, group_size: int | None = None) -> int:
    """Bytes a module takes in the artifact: packed codes + bf16 scales (+ packed zero points when asymmetric)
    (+ shape), or bf16 when kept."""
    n, k = m.shape
    bits = scheme_bits if scheme_bits is not None else m.bits
    g = group_size if scheme_bits is not None else m.group_size
    if not bits:
        return n * k * 2
    codes = n * k * bits // 8
    groups = k // g if g else 1
    scales = n * groups * 2
    zeros = 0 if m.symmetric else -(-n * bits // 32) * groups * 4  # int32 words packed along the output dim
    return codes + scales + zeros + (16 if bits == 4 else 0)


@dataclass
class Option:
    """One scheme a unit can be upgraded to: its members' decisions under it, and why vLLM could not run it."""

    scheme: str  # the recipe's scheme name
    members: list[ModuleDecision]
    refusal: str = ""

    @property
    def bytes(self) -> int:
        return sum(module_bytes(m) for m in self.members)


@dataclass
class Unit:
    """One selectable unit of the plan (a fused group or one projection): its members' decisions under the recipe
    (`base`, 4-bit), under the selection's top `scheme` (`top`, normally INT8) and under each cheaper step short of
    it (selection.steps: smaller int4 groups); qconv.calibrate.select chooses among them under the byte budget."""

    name: str
    role: str
    base: list[ModuleDecision]
    top: list[ModuleDecision]
    refusal: str = ""  # why this unit cannot take the top scheme in vLLM ("" when it can)
    scheme: str = "w8a16"  # the recipe's name for the top decisions (selection.scheme)
    steps: list[Option] = field(default_factory=list)  # upgrades short of the top scheme, in selection.steps order

    @property
    def base_bytes(self) -> int:
        return sum(module_bytes(m) for m in self.base)

    @property
    def top_bytes(self) -> int:
        return sum(module_bytes(m) for m in self.top)

    @property
    def options(self) -> list[Option]:
        return [*self.steps, Option(self.scheme, self.top, self.refusal)]
