"""A recipe's sections as typed dataclasses: schemes, quantizer, calibration, selection, card, KV profiles and
speculation, with the vocabularies (roles, KV schemes) they are checked against."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from qconv.models.family import all_roles
from qconv_vllm.features import KVARN_PRESETS

# The roles a recipe assigns schemes to are every model family's, `all_roles()` (qconv.models: each family file's
# role patterns; a fused group is one role, vLLM fuses it into one layer with one scheme): a new family's role is
# known to recipes without a list here.
KEEP = "bf16"  # the scheme name meaning "leave in the source dtype"
# Runnable by a profile (qconv.kv.schemes builds them from here): vLLM's own, the plugin's KVarN presets, and the
# 256-token tiles that run in qconv's engine only.
KV_SCHEMES = ("bf16", "fp8_e4m3", *KVARN_PRESETS, "kvarn_k4v2_g256", "kvarn_k4v4_g256")


@dataclass
class QuantArgs:
    bits: Literal[4, 8]
    symmetric: bool = True
    strategy: Literal["group", "channel", "tensor", "token"] = "group"
    group_size: int | None = 128
    dynamic: bool = False

    def validate(self):
        if self.strategy == "group" and (
            not self.group_size or self.group_size <= 0 or self.group_size & (self.group_size - 1)
        ):
            yield "group_size", f"group strategy needs a positive power-of-two group_size, got {self.group_size!r}"


@dataclass
class Scheme:
    weights: QuantArgs
    activations: QuantArgs | None = None

    def validate(self):
        if not self.weights.symmetric and (self.weights.bits != 4 or self.activations is not None):
            yield (
                "weights.symmetric",
                (
                    "zero points (symmetric: false) are for int4 weight-only schemes: vLLM 0.32 "
                    "runs them as uint4 (Marlin on GPUs, CPUWNA16 on CPU) and has no kernel for "
                    "8-bit or weight+activation zero points; use symmetric: true"
                ),
            )

    @property
    def label(self) -> str:
        a = self.activations.bits if self.activations else 16
        return f"w{self.weights.bits}a{a}"


# Act-order values compressed-tensors 0.19 takes ("static" is its alias of "weight"); "group" / "dynamic" (g_idx
# reordering kept at runtime) were removed there: QuantizationArgs.validate_actorder raises for them whatever the
# scheme (vLLM's own compressed-tensors 0.17 still parses them, but no build can write them).
ACTORDERS = ("weight", "static")
REMOVED_ACTORDERS = ("group", "dynamic")


# Roles whose Linears a rotation may turn: the decoder's projections (not the tables, nor what stays bf16).
MAX_ROTATION_BLOCK = 1 << 13  # the widest input a block of the models qconv reads divides (a wider one turns nothing)
ROTATABLE = ("attn_qkv", "attn_o", "mlp_gate_up", "mlp_down", "gdn_out")


@dataclass
class Rotation:
    """Input rotations (llm-compressor's QuIPModifier, "v"): each rotated Linear's weight is stored as W·Vᵀ and its
    input turned by V at runtime, V block-diagonal of random Hadamard blocks; spreading outliers across a block
    shrinks the groups' ranges before rounding. vLLM 0.32 applies V as a dense block matmul (its `hadamard` type
    needs the CUDA-only hadacore op, so only `random-hadamard` is offered)."""

    type: Literal["random-hadamard"] = "random-hadamard"
    block_size: int = 64  # must divide the in_features of the Linears it rotates (others stay unrotated)
    # the quantized roles whose Linears are rotated (bf16-kept ones never are)
    roles: list[str] = field(default_factory=lambda: list(ROTATABLE))

    def validate(self):
        if self.block_size < 2 or self.block_size & (self.block_size - 1) or self.block_size > MAX_ROTATION_BLOCK:
            yield (
                "block_size",
                f"must be a power of two from 2 to {MAX_ROTATION_BLOCK}, got {self.block_size} (a block wider than "
                "every Linear's input would rotate nothing)",
            )
        for r in self.roles:
            if r == "gdn_qkvz":
                yield (
                    "roles",
                    "gdn_qkvz cannot be rotated: vLLM 0.32 builds in_proj_qkvz with 4 output shards (q, k, v, z) "
                    "for the checkpoint's 2 parts and fails validating their transforms (KeyError); drop it",
                )
            elif r not in ROTATABLE:
                yield "roles", f"{r!r} cannot be rotated; rotatable roles: {', '.join(ROTATABLE)}"


@dataclass
class Quantizer:
    algorithm: Literal["gptq", "rtn", "awq+gptq", "autoround"] = (
        "gptq"  # awq+gptq: AWQ smoothing (llmcompressor's mappings), then GPTQ; autoround: llmcompressor's AutoRound
    )
    dampening_frac: float = 0.01
    block_size: int = 128
    actorder: str | None = None  # GPTQ column order: weight (= static) | null (none)
    observer: Literal["minmax", "mse"] = (
        "minmax"  # weight scales: min/max, or mse (search shrunk ranges for least error)
    )
    # When a group size does not divide a layer's in_features, try these (largest first) and record the choice.
    group_size_fallback: list[int] = field(default_factory=lambda: [128, 64, 32])
    iters: int = 200  # AutoRound's SignSGD steps per decoder layer
    batch_size: int = 8  # AutoRound's tuning batch (calibration samples per step)
    rotation: Rotation | None = None  # null: weights rounded as they are

    @property
    def gptq(self) -> bool:
        return self.algorithm in ("gptq", "awq+gptq")

    @property
    def calibrated(self) -> bool:
        """Runs layer by layer on calibration data (llmcompressor's sequential pipeline); RTN needs none."""
        return self.algorithm != "rtn"

    def validate(self):
        if self.actorder in REMOVED_ACTORDERS:
            yield (
                "actorder",
                (
                    f"actorder {self.actorder!r} cannot be built: compressed-tensors 0.19 (the build's) "
                    "removed it, QuantizationArgs.validate_actorder rejects it for every scheme and group "
                    "size; use 'weight' (the same GPTQ column order, no g_idx at runtime) or null"
                ),
            )
        elif self.actorder is not None and self.actorder not in ACTORDERS:
            yield "actorder", f"bad value {self.actorder!r}; allowed: 'weight', 'static' (an alias), null"
        elif self.actorder is not None and not self.gptq:
            yield "actorder", f"act-order is a GPTQ option; algorithm {self.algorithm!r} has none: use null"
        if not 0 <= self.dampening_frac < 1:
            yield "dampening_frac", f"must be in [0, 1), got {self.dampening_frac}"
        if self.iters < 1:
            yield "iters", f"must be >= 1 (AutoRound's steps per layer), got {self.iters}"
        if self.rotation is not None and self.algorithm == "awq+gptq":
            yield (
                "rotation",
                "AWQ smoothing cannot run on rotated Linears with llm-compressor 0.14 (it calls a layer's modules "
                "with keyword inputs, which compressed-tensors' rotation hook cannot take: IndexError); set "
                "rotation: null for awq+gptq",
            )
        if self.batch_size < 1:
            yield "batch_size", f"must be >= 1, got {self.batch_size}"


@dataclass
class Calibration:
    dataset: str | None = None  # file path or HF dataset id; None: default_dataset, else self-generated
    default_dataset: str | None = "HuggingFaceH4/ultrachat_200k"
    split: str = "train_sft"
    samples: int = 128
    seq_len: int = 2048
    seed: int = 0

    def validate(self):
        if self.samples <= 0:
            yield "samples", f"must be > 0, got {self.samples}"
        if self.seq_len < 16:
            yield "seq_len", f"must be >= 16, got {self.seq_len}"


@dataclass
class SelectionRules:
    """A recipe's `selection:` section: which units may be upgraded (int4 g64/g32 steps, INT8) by measured
    sensitivity under what budget (0 = uniform 4-bit). Its result is qconv.calibrate.select.Selection."""

    # bytes ("0", "1500000000"), with unit ("1.5GB", "300MiB"), percent of the artifact ("5%"), or "auto": what the
    # card has left after the weights, the tightest profile's KV cache + recurrent state and the reserve
    budget: str = "0"
    scheme: str = "w8a16"
    # cheaper upgrades the budget may buy instead of `scheme` (e.g. int4 with smaller groups), unit by unit, by
    # measured sensitivity per byte; [] = `scheme` only
    steps: list[str] = field(default_factory=list)
    # with `auto`: never promote past this many bits per weight over the whole artifact (None: the card decides).
    # A model far smaller than the card it is built for would otherwise be promoted to INT8 throughout.
    max_bpw: float | None = None
    candidates: list[str] = field(
        default_factory=lambda: ["attn_qkv", "attn_o", "mlp_gate_up", "mlp_down", "gdn_qkvz", "gdn_out"]
    )

    def validate(self):
        if self.budget.strip() != "auto" and not re.fullmatch(r"\s*-?\d+(\.\d+)?\s*(%|[kKMGT]i?B|B)?\s*", self.budget):
            yield (
                "budget",
                (
                    f"bad budget {self.budget!r}; use bytes (1500000000), a size (1.5GB, 300MiB), a percent "
                    "(5%) or auto (what the card has left after its tightest profile)"
                ),
            )
        if self.max_bpw is not None and not 1 <= self.max_bpw <= 16:
            yield "max_bpw", f"must be between 1 and 16 bits per weight, got {self.max_bpw}"
        for c in self.candidates:
            if c not in all_roles():
                yield "candidates", f"unknown role {c!r}; roles: {', '.join(all_roles())}"


W4A8_ROLES = ("attn_qkv", "attn_o", "mlp_gate_up", "mlp_down", "gdn_qkvz", "gdn_out")


@dataclass
class Card:
    name: str
    memory_gib: float
    reserve_gib: float = 1.5  # CUDA context, activations, workspace


@dataclass
class Profile:
    kv_cache: str
    context_length: int
    max_num_seqs: int = 1
    gpu_memory_utilization: float = 0.92
    mamba_ssm_cache_dtype: Literal["float32", "float16", "bfloat16", "auto"] = "float32"
    language_model_only: bool = True
    max_tokens: int | None = None  # completion cap of a chat request that sends none (None: the server's default)
    # Roles whose int4 linears take int8 activations (per-token dynamic) when served: W4A8 on Marlin's int8 input
    # path (CUDA sm80+); the checkpoint stays W4A16, eval/check simulate it on exactly these roles.
    w4a8: list[str] = field(default_factory=list)
    description: str = ""

    def validate(self):
        for role in self.w4a8:
            if role not in W4A8_ROLES:
                yield "w4a8", f"role {role!r} has no int4 linears to run W4A8; roles: {', '.join(W4A8_ROLES)}"
        if self.kv_cache not in KV_SCHEMES:
            yield "kv_cache", f"unknown KV scheme {self.kv_cache!r}; allowed: {', '.join(KV_SCHEMES)}"
        if self.context_length <= 0:
            yield "context_length", f"must be > 0, got {self.context_length}"
        if self.max_num_seqs < 1:
            yield "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}"
        if not 0 < self.gpu_memory_utilization <= 1:
            yield "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
        if self.max_tokens is not None and self.max_tokens <= 0:
            yield "max_tokens", f"must be > 0, got {self.max_tokens}"


@dataclass
class Lookup:
    """Prompt lookup: alone (method lookup) it drafts up to `max_block` tokens; with a model drafter (hybrid) it
    stretches the drafter's k tokens to `max_block` once the drafter's whole proposal was accepted
    `after_saturated` steps running (0: every step)."""

    max_block: int = 15
    ngram_max: int = 4
    ngram_min: int = 2
    after_saturated: int = 0

    def validate(self):
        if not 0 <= self.max_block <= 15:
            yield "max_block", f"must be in 0..15, got {self.max_block}"
        if not 1 <= self.ngram_min <= self.ngram_max:
            yield "ngram_min", f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}"
        if self.after_saturated < 0:
            yield "after_saturated", f"must be >= 0, got {self.after_saturated}"


@dataclass
class Speculative:
    method: Literal["mtp", "lookup", "hybrid", "dflash", "none"] = "hybrid"
    num_speculative_tokens: int = 4
    lookup: Lookup = field(default_factory=Lookup)
    drafter: str | None = None  # a DFlash-style drafter model (Hub id or path), passed to vLLM with method dflash

    def validate(self):
        if self.method == "dflash" and not self.drafter:
            yield "drafter", "method dflash needs a drafter model (Hub id or path)"
        if self.drafter and self.method != "dflash":
            yield "drafter", f"a drafter model is used by method dflash, not {self.method!r}"
        if self.num_speculative_tokens < 0:
            yield "num_speculative_tokens", f"must be >= 0, got {self.num_speculative_tokens}"


# The `quality:` section: the held-out text, the gates per model tier and the regression tolerances.
@dataclass
class Gates:
    max_mean_kld: float | None = None
    max_p99_kld: float | None = None
    min_top1: float | None = None  # fraction 0..1
    max_ppl_ratio: float | None = None  # PPL(quantized) / PPL(original)
    min_task_recovery: float | None = None  # task accuracy quantized / original


@dataclass
class GateTier:
    """Gates for one model class. The tier whose min_params the model reaches (largest first) applies, and the
    report names it: a 135M model is judged by small-model gates, never silently by the 27B's."""

    name: str
    min_params: float
    weights: Gates = field(default_factory=Gates)
    weights_kv: Gates = field(default_factory=Gates)


@dataclass
class Regression:
    """Tolerances for `qconv check --against`: how much worse than the recorded report is still a pass."""

    mean_kld_rel: float = 0.10
    p99_kld_rel: float = 0.20
    top1_abs: float = 0.01
    ppl_ratio_abs: float = 0.01


@dataclass
class Quality:
    text: str | None = None  # held-out text (file or HF dataset id) for the build's quality report
    window: int = 2048
    max_tokens: int = 8192
    tiers: list[GateTier] = field(default_factory=list)
    regression: Regression = field(default_factory=Regression)

    def tier_for(self, num_params: int) -> GateTier | None:
        for t in sorted(self.tiers, key=lambda t: -t.min_params):
            if num_params >= t.min_params:
                return t
        return None
