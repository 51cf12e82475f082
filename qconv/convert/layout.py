"""The per-module plan: which scheme and group size each tensor gets, and what the artifact will weigh.

Works from tensor shapes alone (safetensors headers, or a meta-device model for a config without weights), so the
same code serves `--dry-run` on a 27B config and the real build.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from qconv.calibrate.units import Option, Unit, module_bytes
from qconv.errors import QconvError
from qconv.manifest import ModuleDecision
from qconv.modelfiles import safetensors_header
from qconv.models.family import Family
from qconv.recipes.recipe import Recipe
from qconv.recipes.roles import FUSED, family_of, role_of, text_config, unit_of
from qconv.recipes.sections import KEEP, Scheme

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "F8_E4M3": 1}
# vLLM's Marlin kernel (its W4A16/W8A16 path on Ampere) runs these group sizes, or per channel. Since vLLM 0.32 it
# zero-pads a layer whose in/out widths miss its thread tiles (in % 128 / out % 64), so the group is its only limit
# (vllm/model_executor/kernels/linear/mixed_precision/marlin.py, `can_implement`).
MARLIN_GROUPS = (32, 64, 128)


def marlin_refusal(k: int, group: int | None) -> str:
    """Why vLLM's Marlin cannot run weights of in_features k in groups of `group` (None: per channel); "" if it can."""
    if group is None or group >= k or (group in MARLIN_GROUPS and k % group == 0):
        return ""
    return f"Marlin runs groups of {'/'.join(map(str, MARLIN_GROUPS))} or per channel (group {group}, in {k})"


@dataclass
class Tensor:
    shape: tuple[int, ...]
    bytes_per_elem: int = 2

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Plan:
    family: str
    modules: list[ModuleDecision]
    other_bytes: int  # norms, convs, biases and every tensor that is not a planned module (kept as is)
    source_bytes: int
    warnings: list[str] = field(default_factory=list)
    untie_embeddings: bool = False
    tied_embeddings: bool = False  # kept tied (recipe tied_embeddings: keep): lm_head is embed_tokens
    num_parameters: int = 0
    model_type: str = ""  # config.json's (the outer one for multimodal wrappers): what vLLM builds

    @property
    def quantized_bytes(self) -> int:
        return sum(module_bytes(m) for m in self.modules)

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.other_bytes

    @property
    def untie_bytes(self) -> int:
        """What untying a tied embedding costs: the second copy (lm_head) the artifact stores."""
        return sum(module_bytes(m) for m in self.modules if m.role == "lm_head") if self.untie_embeddings else 0

    def bytes_by_role(self) -> dict[str, dict]:
        out: dict[str, dict] = defaultdict(lambda: {"modules": 0, "params": 0, "bytes": 0, "schemes": set()})
        for m in self.modules:
            r = out[m.role]
            r["modules"] += 1
            r["params"] += m.shape[0] * m.shape[1]
            r["bytes"] += module_bytes(m)
            r["schemes"].add(m.scheme + (f" g{m.group_size}" if m.group_size else "") + ("" if m.symmetric else " zp"))
        return dict(out)

    def units(self) -> dict[str, list[ModuleDecision]]:
        out: dict[str, list[ModuleDecision]] = defaultdict(list)
        for m in self.modules:
            out[unit_of(m.name, m.role)].append(m)
        return dict(out)


def read_safetensors_header(path: Path) -> dict[str, Tensor]:
    return {k: Tensor(tuple(v["shape"]), _DTYPE_BYTES.get(v["dtype"], 2)) for k, v in safetensors_header(path).items()}


def mtp_shapes(tc: dict) -> dict[str, tuple[int, ...]]:
    """Shapes of the qwen3_5 MTP head (`mtp.*`), which transformers does not build: fc, norms, one full-attention
    decoder layer. Used to size it for a config without weights, and by the test fixtures to fake it."""
    layers = int(tc.get("mtp_num_hidden_layers", 0) or 0)
    if not layers:
        return {}
    h, i = tc["hidden_size"], tc["intermediate_size"]
    hd = tc.get("head_dim") or h // tc["num_attention_heads"]
    nq, nkv = tc["num_attention_heads"], tc["num_key_value_heads"]
    gate = 2 if tc.get("attn_output_gate", True) else 1
    out = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    for li in range(layers):
        p = f"mtp.layers.{li}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nq * hd * gate, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    return out


def meta_tensors(folder: Path, config: dict) -> dict[str, Tensor]:
    """Tensor shapes for a config without weights: build the model on the meta device (no memory)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        model = cls._from_config(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
    out = {n: Tensor(tuple(p.shape)) for n, p in model.named_parameters()}
    out.update({n: Tensor(s) for n, s in mtp_shapes(text_config(config)).items()})
    return out


def tensor_table(folder: Path, config: dict) -> dict[str, Tensor]:
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        return meta_tensors(folder, config)
    out: dict[str, Tensor] = {}
    for s in shards:
        out.update(read_safetensors_header(s))
    return out


def _pick_group(k: int, want: int, fallback: list[int]) -> int | None:
    if k % want == 0:
        return want
    for g in sorted(fallback, reverse=True):
        if g <= want and k % g == 0:
            return g
    return None


def decide(
    name: str, role: str, shape: tuple[int, int], scheme_name: str, scheme: Scheme | None, recipe: Recipe
) -> tuple[ModuleDecision, list[str]]:
    """One module's decision, with the group-size fallback and Marlin warnings recorded on it."""
    n, k = shape
    if scheme is None:
        return ModuleDecision(name=name, role=role, scheme=KEEP, shape=[n, k]), []
    w = scheme.weights
    notes, warns = [], []
    g = None
    if w.strategy == "group" and w.group_size:  # a group scheme names its size (recipes/schema validates it)
        g = _pick_group(k, w.group_size, recipe.quantizer.group_size_fallback)
        if g is None:
            note = (
                f"in_features {k} not divisible by any group size in {recipe.quantizer.group_size_fallback}: kept bf16"
            )
            return ModuleDecision(name=name, role=role, scheme=KEEP, shape=[n, k], note=note), [f"{name}: {note}"]
        if g != w.group_size:
            notes.append(f"group {g} ({k} % {w.group_size} != 0)")
    if why := marlin_refusal(k, g):
        notes.append(f"no Marlin: {why}")
        warns.append(
            f"{name} [{n}x{k}]: vLLM's Marlin kernel cannot run this group size; vLLM falls back to a slower kernel"
        )
    label = scheme.label
    return ModuleDecision(
        name=name,
        role=role,
        scheme=label,
        bits=w.bits,
        group_size=g,
        shape=[n, k],
        note="; ".join(notes),
        symmetric=w.symmetric,
    ), warns


def head_is_tied(config: dict, names) -> bool:
    """A tied model whose checkpoint stores no lm_head tensor of its own: lm_head is embed_tokens."""
    tc = text_config(config)
    tied = bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    return tied and not any(role_of(n.rpartition(".")[0]) == "lm_head" for n in names)


def kept_plan(folder: Path, config: dict, modules: list[ModuleDecision]) -> Plan:
    """The plan of a build that keeps a checkpoint's own layout (already-quantized sources): what `requires` reads,
    the model type vLLM builds and whether lm_head is the embedding table."""
    return Plan(
        family=family_of(config).name,
        modules=modules,
        other_bytes=0,
        source_bytes=0,
        model_type=config.get("model_type", ""),
        tied_embeddings=head_is_tied(config, tensor_table(folder, config)),
    )


def plan_model(folder: Path, config: dict, recipe: Recipe) -> Plan:
    """The per-module plan for a model folder (weights or config only) under a recipe."""
    family = family_of(config)
    check_roles(recipe, family)
    tensors = tensor_table(folder, config)
    modules, warnings, planned = [], [], set()
    names = list(tensors)
    untie = kept_tied = False
    if head_is_tied(config, names):
        emb = next((n for n in names if role_of(n[:-7]) == "embed"), None)
        if emb and recipe.tied_embeddings == "keep":
            kept_tied = True
            warnings.append(
                f"tied embeddings kept tied: lm_head shares embed_tokens' {recipe.scheme_for('embed')} "
                "table (one copy; tied_embeddings: keep)"
            )
        elif emb and recipe.scheme_for("lm_head") != KEEP:
            untie = True
            tensors = dict(tensors)
            tensors["lm_head.weight"] = tensors[emb]
            names.append("lm_head.weight")
    for name in names:
        t = tensors[name]
        if not name.endswith(".weight") or len(t.shape) != 2:
            continue
        mod = name[: -len(".weight")]
        role = role_of(mod, family)
        if role is None:
            continue
        scheme_name = recipe.scheme_for(role)
        scheme = None if scheme_name == KEEP else recipe.schemes[scheme_name]
        d, w = decide(mod, role, t.shape, scheme_name, scheme, recipe)
        modules.append(d)
        warnings.extend(w)
        planned.add(name)
    other = sum(2 * t.numel for n, t in tensors.items() if n not in planned)  # kept tensors are written bf16
    source = sum(t.bytes_per_elem * t.numel for n, t in tensors.items() if not (untie and n == "lm_head.weight"))
    params = sum(t.numel for n, t in tensors.items() if not (untie and n == "lm_head.weight"))
    plan = Plan(
        family=family.name,
        modules=modules,
        other_bytes=other,
        source_bytes=source,
        warnings=warnings,
        untie_embeddings=untie,
        num_parameters=params,
        model_type=config.get("model_type", ""),
        tied_embeddings=kept_tied,
    )
    if untie:
        extra = plan.untie_bytes
        warnings.append(
            f"tied embeddings untied: lm_head is a second copy so it can carry its own scheme "
            f"(+{extra / 1e6:.1f} MB, +{8 * extra / max(params, 1):.2f} bits per weight; "
            "tied_embeddings: keep shares one copy)"
        )
    check_fused(plan)
    return plan


def check_roles(recipe: Recipe, family: Family) -> None:
    """A recipe must quantize some role the model's family has: one that names none of them would leave the whole
    model at its source precision (a recipe may name other families' roles too: one recipe serves many)."""
    quantized = [r for r, s in recipe.roles.items() if s != KEEP]
    if quantized and not set(quantized) & set(family.roles):
        raise QconvError(
            f"recipe {recipe.name!r} quantizes roles {', '.join(quantized)}, none of which the {family.name} family "
            f"has (its roles: {', '.join(family.roles)})",
            where="recipe roles",
            fix=f"give schemes to the {family.name} roles ({', '.join(family.roles)})",
        )


def check_fused(plan: Plan) -> None:
    """vLLM fuses q/k/v, gate/up, in_proj_qkv/z into one layer: one scheme and one group size per fused unit."""
    for unit, members in plan.units().items():
        if len({(m.scheme, m.group_size) for m in members}) > 1:
            detail = ", ".join(f"{m.name}={m.scheme}/g{m.group_size}" for m in members)
            raise QconvError(
                f"fused group {unit} would get mixed schemes ({detail})",
                where="recipe",
                fix="vLLM loads a fused layer with one scheme: give the whole group one scheme and a "
                "group size that divides every member",
            )


# vLLM's int8 GEMM (cutlass scaled_mm) needs 16-aligned K and N for W8A8.
CUTLASS_ALIGN = 16


def int8_refusal(role: str, w8: list[ModuleDecision], recipe: Recipe, scheme: str) -> str:
    """Why vLLM could not run this unit at 8 bits ("" if it can). On Ampere with bf16 activations stock vLLM's W8A16
    kernel is Marlin (Exllama is fp16-only, Triton's is 4-bit, Conch and Humming are optional packages), so its
    limits are hard here; W8A8 goes through cutlass scaled_mm."""
    kept = [m for m in w8 if m.scheme == KEEP]
    if kept:
        return kept[0].note or "no group size fits"
    k = w8[0].shape[1]
    n = sum(m.shape[0] for m in w8) if role in FUSED else w8[0].shape[0]
    if recipe.schemes[scheme].activations:
        if k % CUTLASS_ALIGN or n % CUTLASS_ALIGN:
            return f"cutlass int8 needs in%{CUTLASS_ALIGN}==0 and out%{CUTLASS_ALIGN}==0 (in {k}, out {n})"
        return ""
    why = marlin_refusal(k, w8[0].group_size)
    return f"W8A16 needs Marlin: {why}" if why else ""


def _refusal(role: str, members: list[ModuleDecision], recipe: Recipe, scheme: str) -> str:
    if recipe.schemes[scheme].weights.bits >= 8:
        return int8_refusal(role, members, recipe, scheme)
    kept = [m for m in members if m.scheme == KEEP]
    return (kept[0].note or "no group size fits") if kept else ""  # 4-bit: the base's own kernel limits apply


def candidate_units(plan: Plan, recipe: Recipe) -> list[Unit]:
    """The recipe's candidate roles as units, with their 8-bit decisions, their cheaper steps that change anything
    (a step whose group size the fallback already gave the base is dropped) and any refusal."""
    sel = recipe.selection
    s8 = recipe.schemes[sel.scheme]
    units = []
    for name, members in plan.units().items():
        role = members[0].role
        if role not in sel.candidates:
            continue
        if any(m.scheme == KEEP or (m.bits or 16) >= s8.weights.bits for m in members):
            if recipe.scheme_for(role) == KEEP:
                raise QconvError(
                    f"INT8 candidate role {role!r} is kept bf16 by the recipe",
                    where="selection.candidates",
                    fix=f"selection upgrades 4-bit units only: drop {role} from selection.candidates",
                )
            continue  # a member the plan already keeps (no group size fits): nothing to upgrade
        w8 = [decide(m.name, m.role, (m.shape[0], m.shape[1]), sel.scheme, s8, recipe)[0] for m in members]
        unit = Unit(
            name=name,
            role=role,
            base=members,
            top=w8,
            refusal=int8_refusal(role, w8, recipe, sel.scheme),
            scheme=sel.scheme,
        )
        for step in sel.steps:
            opt = Option(
                step,
                [
                    decide(m.name, m.role, (m.shape[0], m.shape[1]), step, recipe.schemes[step], recipe)[0]
                    for m in members
                ],
            )
            opt.refusal = _refusal(role, opt.members, recipe, step)
            if opt.refusal or opt.bytes > unit.base_bytes:
                unit.steps.append(opt)
        units.append(unit)
    return units


def apply_selection(plan: Plan, units: list[Unit], choices: dict[str, str]) -> list[ModuleDecision]:
    """The plan's modules with each chosen unit's (Selection.choices: unit -> scheme) members switched to that
    scheme's decisions."""
    repl = {
        m.name: m
        for u in units
        if u.name in choices
        for o in u.options
        if o.scheme == choices[u.name]
        for m in o.members
    }
    return [repl.get(m.name, m) for m in plan.modules]


def bpw_budget(bpw: float, plan: Plan) -> int:
    """The bytes a bits-per-weight target leaves for 8-bit upgrades over the recipe's plan, counted as the quality
    report counts bpw (artifact tensor bytes x 8 / source parameters)."""
    base = 8 * plan.total_bytes / max(plan.num_parameters, 1)
    if not math.isfinite(bpw) or bpw <= 0 or bpw < base - 1e-9:  # options.check_bpw refused nan/inf earlier
        raise QconvError(
            f"bits-per-weight target {bpw} is below the recipe's uniform plan ({base:.3f} bpw)",
            where="--bpw",
            fix=f"use --bpw >= {base:.2f}, or a recipe with smaller schemes",
        )
    return int(bpw * plan.num_parameters / 8) - plan.total_bytes
