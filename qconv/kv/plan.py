"""The memory-fit planner: what a model (or artifact) needs on a card, per runtime profile, and what fits.

Per sequence: full-attention KV bytes per token x (context + draft block) + the scheme's exact fp16 tokens (KVarN
sink and tile in progress) + Gated-DeltaNet state (conv + recurrent) x state slots, where speculative decoding keeps
one slot per draft position. Budget: card x gpu_memory_utilization - activation/workspace reserve - weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qconv.artifact import Artifact
from qconv.calibrate.units import module_bytes
from qconv.convert.layout import layout_model
from qconv.errors import QconvError
from qconv.kv.schemes import GPU_RUNTIME, get_kv_scheme
from qconv.kv.store import EXACT_DTYPE
from qconv.modelfiles import read_model_config
from qconv.models.spec import ModelSpec
from qconv.recipes.recipe import Recipe, load_recipe
from qconv.recipes.sections import Profile

GIB = 1 << 30
# Nominal memory per card (GiB). --card-gib overrides.
CARDS: dict[str, tuple[str, float]] = {
    "3060": ("RTX 3060 12GB", 12),
    "4060ti": ("RTX 4060 Ti 16GB", 16),
    "4080": ("RTX 4080", 16),
    "3090": ("RTX 3090", 24),
    "4090": ("RTX 4090", 24),
    "5090": ("RTX 5090", 32),
    "a6000": ("RTX A6000", 48),
    "l40s": ("L40S", 48),
    "a100-40": ("A100 40GB", 40),
    "a100-80": ("A100 80GB", 80),
    "h100-80": ("H100 80GB", 80),
    "h200": ("H200", 141),
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
COMPARE = ("bf16", "fp8_e4m3", "kvarn_k4v4_g128", "kvarn_k4v2_g128")


@dataclass
class ModelDims:
    full_layers: int
    kv_heads: int
    head_dim: int
    linear_layers: int = 0
    conv_elems: int = 0  # per linear layer: conv_dim x (kernel - 1)
    recurrent_elems: int = 0  # per linear layer: v_heads x k_dim x v_dim
    config_ssm_dtype: str = "float32"
    mtp_layers: int = 0
    max_position: int = 0
    q_heads: int = 0
    sliding_layers: int = 0  # sliding-window attention layers: K/V of the last `sliding_window` tokens
    sliding_window: int = 0


def model_dims(spec: ModelSpec) -> ModelDims:
    """The planner's numbers of a model; which layers are full, sliding-window or linear attention and what a
    linear layer keeps per sequence come from its Family (through the spec)."""
    d = ModelDims(
        spec.full_layers,
        spec.kv_heads,
        spec.head_dim,
        spec.linear_layers,
        mtp_layers=spec.mtp_layers,
        max_position=spec.max_positions,
        q_heads=spec.heads,
        sliding_layers=spec.sliding_layers,
        sliding_window=int(spec.sliding_window or 0) if spec.sliding_layers else 0,
    )
    if (st := spec.linear_state) is not None:
        d.conv_elems, d.recurrent_elems, d.config_ssm_dtype = st.conv_elems, st.recurrent_elems, st.ssm_dtype
    return d


@dataclass
class Weights:
    total: int  # every weight file
    resident: int  # what the GPU holds for the profile (vision tower dropped, MTP only when it drafts)
    source: str  # "manifest" | "estimate"
    vision: int = 0
    mtp: int = 0


def weights(folder: Path, config: dict, recipe: Recipe, art: Artifact | None = None) -> tuple[int, int, int, str]:
    """(total, vision, mtp) bytes: the artifact's file table when it is one (`art`), else an estimate from the
    config + recipe (qconv.convert.layout, tensor shapes only: no weights are loaded)."""
    if art is not None:
        m = art.manifest
        total = sum(f.size for n, f in m.files.items() if n.endswith(".safetensors"))
        modules, source = m.modules, "manifest"
    else:
        p = layout_model(folder, config, recipe)
        total, modules, source = p.total_bytes, p.modules, "estimate"
    by_role = {r: sum(module_bytes(x) for x in modules if x.role == r) for r in ("vision", "mtp")}
    return total, by_role["vision"], by_role["mtp"], source


@dataclass
class ProfileFit:
    name: str
    profile: Profile
    kv_per_token: int  # model's full-attention layers
    draft_kv_per_token: int  # the MTP drafter's own attention layer(s)
    kv_exact_bytes: int  # exact fp16 tokens per sequence (sink + tile in progress)
    state_bytes: int  # one GDN state slot
    state_slots: int
    draft_block: int  # draft tokens a sequence may hold beyond its context while verifying
    usable: int  # bytes left for KV + state after weights, reserve and the KV runtime's work memory
    work_bytes: int = 0  # the KV runtime's work memory beside the pool (KVarN: staging + attention work)
    window_kv_per_token: int = 0  # the sliding-window layers'
    window_tokens: int = 0  # most tokens a sliding-window layer holds per sequence (window + tokens in flight)
    max_context: dict[str, int] = field(default_factory=dict)  # single sequence, per KV scheme

    @property
    def runtime(self) -> str | None:
        """What runs this profile's KV cache on the card (None: nothing does; our engine runs it on the CPU)."""
        return GPU_RUNTIME.get(self.profile.kv_cache)

    def per_seq(self, context: int) -> int:
        tokens = context + self.draft_block
        kv = (self.kv_per_token + self.draft_kv_per_token) * tokens + self.kv_exact_bytes
        window = self.window_kv_per_token * min(tokens, self.window_tokens)
        return kv + window + self.state_bytes * self.state_slots

    @property
    def need(self) -> int:
        return self.per_seq(self.profile.context_length) * self.profile.max_num_seqs

    @property
    def fits(self) -> bool:
        """Enough memory, and a runtime that can run it on the card."""
        return self.need <= self.usable and self.runtime is not None

    @property
    def max_seqs(self) -> int:
        return max(0, self.usable // self.per_seq(self.profile.context_length))


@dataclass
class FitReport:
    model: str
    card: str
    card_gib: float
    reserve_gib: float
    dims: ModelDims
    weights: Weights
    speculative: str
    profiles: list[ProfileFit]


VLLM_BATCHED_TOKENS = 2048  # vLLM 0.32's max_num_batched_tokens for its API server on cards under 70 GiB
# vLLM 0.32 on a GPU schedules asynchronously: 2 batches in flight. A sliding-window layer frees blocks only once
# their tokens are processed, so each sequence holds up to window - 1 + this many tokens there (SlidingWindowSpec).
VLLM_IN_FLIGHT_TOKENS = 2 * VLLM_BATCHED_TOKENS


def window_tokens(window: int, in_flight: int = VLLM_IN_FLIGHT_TOKENS) -> int:
    """Most tokens vLLM keeps per sequence in a sliding-window layer (0: the model has none)."""
    return window - 1 + in_flight if window else 0


def _max_context(usable: int, kv_tok: int, fixed: int, window_tok: int = 0, window: int = 0) -> int:
    """Longest context that fits: sliding-window layers cost per token up to `window` tokens, then a constant."""
    if not kv_tok:
        return 0
    n = (usable - fixed - window_tok * window) // kv_tok
    if n < window:
        n = (usable - fixed) // (kv_tok + window_tok)
    return max(0, n)


def fit_profile(
    name: str,
    p: Profile,
    dims: ModelDims,
    recipe: Recipe,
    w_resident: int,
    card_gib: float,
    draft_len: int,
    uses_mtp: bool,
) -> ProfileFit:
    usable = int(card_gib * GIB * p.gpu_memory_utilization - recipe.card.reserve_gib * GIB) - w_resident
    draft_layers = dims.mtp_layers if uses_mtp else 0

    def work(scheme_name: str) -> int:
        return get_kv_scheme(scheme_name).serving_work_bytes(
            dims.full_layers + dims.sliding_layers + draft_layers,
            dims.q_heads or dims.kv_heads,
            dims.kv_heads,
            dims.head_dim,
            p.max_num_seqs,
            VLLM_BATCHED_TOKENS,
        )

    ssm = dims.config_ssm_dtype if p.mamba_ssm_cache_dtype == "auto" else p.mamba_ssm_cache_dtype
    state = dims.linear_layers * (dims.conv_elems * 2 + dims.recurrent_elems * DTYPE_BYTES[ssm])
    spec = recipe.speculative
    block = 0 if spec.method == "none" else max(spec.num_speculative_tokens, spec.lookup.max_block)
    slots = 1 + (draft_len if dims.linear_layers else 0)

    def kv(scheme_name: str) -> tuple[int, int, int, int]:
        s = get_kv_scheme(scheme_name)
        per_head = s.bytes_per_token_per_head(dims.head_dim)
        exact = s.max_exact_tokens() * 2 * dims.head_dim * EXACT_DTYPE.itemsize
        return (
            round(dims.full_layers * dims.kv_heads * per_head),
            round(draft_layers * dims.kv_heads * per_head),
            (dims.full_layers + dims.sliding_layers + draft_layers) * dims.kv_heads * exact,
            round(dims.sliding_layers * dims.kv_heads * per_head),
        )

    tok, draft_tok, exact, win_tok = kv(p.kv_cache)
    win = window_tokens(dims.sliding_window)
    fit = ProfileFit(name, p, tok, draft_tok, exact, state, slots, block, usable - work(p.kv_cache), work(p.kv_cache))
    fit.window_kv_per_token, fit.window_tokens = win_tok, win
    for s in dict.fromkeys((p.kv_cache, *COMPARE)):
        t, d, e, w = kv(s)
        fit.max_context[s] = max(0, _max_context(usable - work(s), t + d, e + state * slots, w, win) - block)
    return fit


def plan_fit(
    model: str | Path,
    *,
    card: str = "3090",
    card_gib: float | None = None,
    recipe: str | None = None,
    profile: str | None = None,
    draft_len: int | None = None,
) -> FitReport:
    """`qconv plan`: read the folder (artifact, model or config only), pick recipe and card, fit every profile."""
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise QconvError(
            f"no config.json in {folder}",
            where="MODEL_OR_ARTIFACT",
            fix="pass a model folder, an artifact folder or a config-only folder",
        )
    config = read_model_config(folder)
    art = Artifact.find(folder)
    rec = load_recipe(recipe) if recipe else art.require_recipe() if art is not None else load_recipe("3090")
    if card_gib is None:
        if card.lower() not in CARDS:
            raise QconvError(
                f"unknown card {card!r}",
                where="--card",
                fix=f"use one of {', '.join(CARDS)} or give the memory with --card-gib N",
            )
        card_name, card_gib = CARDS[card.lower()]
    else:
        card_name = card if card.lower() not in CARDS else CARDS[card.lower()][0]
        if card_gib <= 0:
            raise QconvError(f"--card-gib must be > 0, got {card_gib}", where="--card-gib")
    if profile is not None and profile not in rec.profiles:  # before the (slow) weight estimate
        raise QconvError(
            f"unknown profile {profile!r} in recipe {rec.name}",
            where="--profile",
            fix=f"use one of {', '.join(rec.profiles)}",
        )
    return build_report(
        str(folder),
        config,
        rec,
        *weights(folder, config, rec, art),
        card_name,
        card_gib,
        profile=profile,
        draft_len=draft_len,
    )


def build_report(
    label: str,
    config: dict,
    rec: Recipe,
    total: int,
    vision: int,
    mtp: int,
    source: str,
    card_name: str,
    card_gib: float,
    *,
    profile: str | None = None,
    draft_len: int | None = None,
) -> FitReport:
    """The fit of every (or one) profile of `rec` for a model of `config` whose weight files total `total` bytes."""
    dims = model_dims(ModelSpec.from_config(label, config))
    spec = rec.speculative
    uses_mtp = spec.method in ("mtp", "hybrid") and mtp > 0
    if draft_len is None:
        draft_len = 0 if spec.method == "none" else spec.num_speculative_tokens
    fits = []
    for name, p in rec.profiles.items():
        if profile is not None and name != profile:
            continue
        resident = total - (vision if p.language_model_only else 0) - (0 if uses_mtp else mtp)
        fits.append(fit_profile(name, p, dims, rec, resident, card_gib, draft_len, uses_mtp))
    resident = total - vision - (0 if uses_mtp else mtp)
    spec_s = (
        "none"
        if spec.method == "none"
        else (
            f"{spec.method}: {spec.num_speculative_tokens} drafted tokens (lookup block up to {spec.lookup.max_block})"
            + (f", {draft_len} extra GDN state slot(s) per sequence" if dims.linear_layers else "")
        )
    )
    return FitReport(
        label,
        card_name,
        card_gib,
        rec.card.reserve_gib,
        dims,
        Weights(total, resident, source, vision, mtp if uses_mtp else 0),
        spec_s,
        fits,
    )


def upgrade_headroom(
    config: dict, recipe: Recipe, total_bytes: int, vision_bytes: int = 0, mtp_bytes: int = 0
) -> tuple[int, ProfileFit]:
    """`selection.budget: auto`: the bytes the recipe's card has left once the weights (`total_bytes`, uniform W4)
    and each profile's KV cache at its context length plus the recurrent state are placed, after the reserve — the
    slack of the tightest profile's fit, never negative. Promoting at most this much keeps every profile the
    artifact promises fitting, not just the default one."""
    r = build_report(
        "", config, recipe, total_bytes, vision_bytes, mtp_bytes, "estimate", recipe.card.name, recipe.card.memory_gib
    )
    fit = min(r.profiles, key=lambda f: f.usable - f.need)
    return max(0, fit.usable - fit.need), fit
