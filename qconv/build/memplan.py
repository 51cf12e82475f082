"""The build's device-memory plan: the peak of each phase of a streamed GPTQ build on the device it runs on,
computed from the model's shapes and the recipe (nothing loaded), and its projected wall time from the FLOP model
of docs/BENCHMARKS.md ("Projected 64-layer times"). `qconv build --dry-run` prints it; a real build refuses,
before anything is written, a device the plan does not fit, naming the knob to turn.

What each phase holds (llmcompressor's sequential pipeline, one subgraph onloaded at a time, batch size 1):
- a decoder layer's calibration: its bf16 weights, one float32 Hessian per quantized Linear (all kept until the
  layer's GPTQ), one calibration sample's activations inside the layer, and the float32 [in, in] product that
  llmcompressor's `hessian += inp.matmul(inp.t())` makes before adding it (the widest module's: 1.13 GiB for the
  27B's 17,408-wide down_proj);
- its GPTQ: weights, Hessians, and the widest module's work (its Cholesky factor and inverse, a bf16 stack of its
  weight, four float32 copies of one row block);
- embed_tokens (round-to-nearest, its own subgraph): the table and one sample's hidden states;
- lm_head (its own subgraph): the weight, its Hessian and one sample's logits during calibration; then GPTQ and
  the MSE observer in row blocks (qconv.convert.stream.row_blocked_gptq), the block sized from free memory.
Estimates of what llmcompressor and PyTorch allocate, not measurements: `bench/gpu_build.py` measures them
(the build's log gives each layer's peak allocated and reserved memory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qconv.convert.device import gptq_block_bytes
from qconv.convert.layout import Plan
from qconv.errors import QconvError
from qconv.kv.plan import CARDS, GIB
from qconv.models.family import family_for, layer_index
from qconv.recipes.recipe import Recipe
from qconv.recipes.sections import KEEP

# CUDA context and the caching allocator's slack, kept off the card's memory before the phases are fitted.
CUDA_OVERHEAD = GIB
# Spec-sheet fp32 peak (TFLOPS) of the cards in qconv.kv.plan.CARDS; the projection takes EFFICIENCY of it for the
# forwards and Hessians and GPTQ_SHARE of that for GPTQ's sequential column loop (BENCHMARKS.md's model).
FP32_TFLOPS = {
    "3060": 12.7,
    "4060ti": 22.1,
    "4080": 48.7,
    "3090": 35.6,
    "4090": 82.6,
    "5090": 104.8,
    "a6000": 38.7,
    "l40s": 91.6,
    "a100-40": 19.5,
    "a100-80": 19.5,
    "h100-80": 67.0,
    "h200": 67.0,
}
EFFICIENCY, GPTQ_SHARE, DISK_BYTES_S = 0.7, 0.1, 2e9


@dataclass
class Phase:
    name: str
    parts: dict[str, int]  # what is resident at the phase's peak -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())


@dataclass
class DevicePlan:
    device: str
    target: str  # the card or memory it is planned for, in words
    capacity: int  # bytes the phases may use
    samples: int
    seq_len: int
    block_bytes: int
    phases: list[Phase] = field(default_factory=list)
    seconds: dict[str, float] | None = None  # projected wall time (GPU cards with a known fp32 peak)

    def over(self) -> list[Phase]:
        return [p for p in self.phases if p.bytes > self.capacity]

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        out = [
            f"device memory plan: {self.device} on {self.target}, {g(self.capacity)} for the build; calibration "
            f"{self.samples} x {self.seq_len} tokens (one sample a batch); row blocks {g(self.block_bytes)}"
        ]
        for p in self.phases:
            verdict = "ok" if p.bytes <= self.capacity else "DOES NOT FIT"
            parts = ", ".join(f"{k} {g(v)}" for k, v in p.parts.items())
            out.append(f"  {p.name:<26} {g(p.bytes):>10}  {verdict}  ({parts})")
        if self.seconds:
            s = self.seconds
            out.append(
                f"projected wall time (FLOP model of docs/BENCHMARKS.md, not measured): {s['layers']} layers x "
                f"{s['per_layer']:.0f} s (forwards + Hessians {s['forward']:.0f} s, GPTQ {s['gptq']:.0f} s, "
                f"disk {s['disk']:.0f} s) + lm_head {s['head']:.0f} s = {s['total'] / 60:.0f} min"
            )
        return out

    def check(self) -> None:
        """Refuse a build that cannot fit, with the knob that shrinks the phase that does not."""
        over = self.over()
        if not over:
            return
        worst = max(over, key=lambda p: p.bytes)
        acts = max((p.parts.get("activations", 0) for p in over), default=0)
        knob = (
            f"lower --seq-len (one sample's activations take {acts / GIB:.2f} GiB at {self.seq_len} tokens), "
            if acts
            else ""
        )
        raise QconvError(
            f"the build does not fit on {self.target}: {worst.name} needs {worst.bytes / GIB:.2f} GiB "
            f"of {self.capacity / GIB:.2f} GiB",
            where="--device",
            fix=f"{knob}or build with --device cpu (host memory, hours a layer; see docs/BENCHMARKS.md)",
        )


def card_target(card: str | None, recipe: Recipe) -> tuple[str, int, float | None]:
    """(name, bytes, fp32 TFLOPS or None) of `--card` (a qconv.kv.plan.CARDS key) or else the recipe's card."""
    if card is not None:
        if card.lower() not in CARDS:
            raise QconvError(f"unknown card {card!r}", where="--card", fix=f"use one of {', '.join(CARDS)}")
        name, gib = CARDS[card.lower()]
        return name, int(gib * GIB), FP32_TFLOPS.get(card.lower())
    key = next((k for k, (n, _) in CARDS.items() if n == recipe.card.name), None)
    return recipe.card.name, int(recipe.card.memory_gib * GIB), FP32_TFLOPS.get(key) if key else None


def _layers(plan: Plan) -> dict[int, list]:
    out: dict[int, list] = {}
    for m in plan.modules:
        layer = layer_index(m.name)
        if layer is not None and not m.name.startswith("mtp.") and m.role != "vision":
            out.setdefault(layer, []).append(m)
    return out


def _gptq_work(m, block: int) -> int:
    rows, cols = m.shape
    return 2 * cols * cols * 4 + rows * cols * 2 + 4 * min(block, rows * cols * 4)


def _activations(config: dict, layer_modules: list, seq: int) -> int:
    """One sample's activations inside a decoder layer: hidden in/out/residual, the MLP's three intermediates,
    the Hessian hook's float32 input (and its scaled copy) of the widest module, and attention scores (eager /
    math SDPA, the upper bound) or Gated-DeltaNet's float32 q/k/v chunks."""
    tc = config.get("text_config", config)
    h, inter = tc["hidden_size"], tc.get("intermediate_size") or 0
    widest = max((m.shape[1] for m in layer_modules), default=h)
    heads = tc.get("num_attention_heads") or 1
    attn = heads * seq * seq * 4
    state = family_for(config.get("model_type", "")).linear_state
    if state is not None and tc.get("linear_num_value_heads"):
        attn = max(attn, 4 * seq * state(tc).conv_dim * 4)
    return 3 * seq * h * 2 + 3 * seq * inter * 2 + 2 * seq * widest * 4 + attn


def device_plan(
    plan: Plan,
    config: dict,
    recipe: Recipe,
    *,
    device: str,
    samples: int,
    seq_len: int,
    capacity: int,
    target: str,
    tflops: float | None = None,
) -> DevicePlan:
    """The phases' peaks on a device with `capacity` bytes free for the build."""
    block = gptq_block_bytes(device, free=capacity) if device != "cpu" else gptq_block_bytes("cpu")
    dp = DevicePlan(device, target, capacity, samples, seq_len, block)
    layers = _layers(plan)
    quantized = lambda ms: [m for m in ms if m.scheme != KEEP and recipe.quantizer.gptq]  # noqa: E731
    big = max(layers.values(), key=lambda ms: sum(m.shape[0] * m.shape[1] for m in ms), default=[])
    acts = max((_activations(config, ms, seq_len) for ms in layers.values()), default=0)
    if big:
        weights = sum(m.shape[0] * m.shape[1] * 2 for m in big)
        hess = sum(m.shape[1] ** 2 * 4 for m in quantized(big))
        work = max((_gptq_work(m, block) for m in quantized(big)), default=0)
        update = max((m.shape[1] ** 2 * 4 for m in quantized(big)), default=0)  # inp @ inp.T before +=
        dp.phases.append(
            Phase(
                "decoder layer: calibration",
                {"weights": weights, "Hessians": hess, "activations": acts, "Hessian update": update},
            )
        )
        dp.phases.append(Phase("decoder layer: GPTQ", {"weights": weights, "Hessians": hess, "GPTQ work": work}))
    tc = config.get("text_config", config)
    hidden = seq_len * tc["hidden_size"] * 2
    for m in plan.modules:
        rows, cols = m.shape
        if m.role == "embed":
            dp.phases.append(Phase("embed_tokens", {"table": rows * cols * 2, "hidden states": hidden}))
        elif m.role == "lm_head" and not plan.tied_embeddings:
            w, hs = rows * cols * 2, cols * cols * 4
            upd = hs if m.scheme != KEEP and recipe.quantizer.gptq else 0
            dp.phases.append(
                Phase(
                    "lm_head: calibration",
                    {
                        "weight": w,
                        "Hessian": hs,
                        "Hessian update": upd,
                        "hidden states": hidden,
                        "logits": seq_len * rows * 2,
                    },
                )
            )
            if m.scheme != KEEP:
                dp.phases.append(
                    Phase("lm_head: GPTQ row blocks", {"weight": w, "Hessian": hs, "GPTQ work": _gptq_work(m, block)})
                )
    if tflops and layers:
        dp.seconds = projection(plan, layers, recipe, samples * seq_len, tflops)
    return dp


def projection(plan: Plan, layers: dict[int, list], recipe: Recipe, tokens: int, tflops: float) -> dict:
    """BENCHMARKS.md's FLOP model: per layer, two forwards (calibrate, propagate) of 2 FLOP a weight a token and
    the Hessians (2 x in^2 a token a quantized module) at EFFICIENCY of the fp32 peak, GPTQ (2 x rows x in^2 + in^3/3
    a module) at GPTQ_SHARE of that, and the disk (weights read, activations written and read back) at 2 GB/s."""
    rate = tflops * 1e12 * EFFICIENCY
    tc_hidden = next(m.shape[1] for m in plan.modules if m.role in ("embed", "lm_head"))
    per = []
    for ms in layers.values():
        q = [m for m in ms if m.scheme != KEEP] if recipe.quantizer.gptq else []
        params = sum(m.shape[0] * m.shape[1] for m in ms)
        fwd = (2 * 2 * params + sum(2 * m.shape[1] ** 2 for m in q)) * tokens / rate
        gptq = sum(2 * m.shape[0] * m.shape[1] ** 2 + m.shape[1] ** 3 / 3 for m in q) / (rate * GPTQ_SHARE)
        disk = (2 * params + 2 * 2 * tokens * tc_hidden) / DISK_BYTES_S
        per.append((fwd, gptq, disk))
    head = next((m for m in plan.modules if m.role == "lm_head"), None)
    head_s = 0.0
    if head is not None:
        rows, cols = head.shape
        head_s = (
            (2 * rows * cols + 2 * cols * cols) * tokens / rate
            + (2 * rows * cols * cols + cols**3 / 3) / (rate * GPTQ_SHARE)
            + 2 * rows * cols / DISK_BYTES_S
        )
    n = len(per)
    fwd, gptq, disk = (sum(p[i] for p in per) / n for i in range(3))
    total = sum(sum(p) for p in per) + head_s
    return {
        "layers": n,
        "per_layer": fwd + gptq + disk,
        "forward": fwd,
        "gptq": gptq,
        "disk": disk,
        "head": head_s,
        "total": total,
    }


def build_plan(
    plan: Plan, config: dict, recipe: Recipe, *, device: str, samples: int, seq_len: int, card: str | None = None
) -> DevicePlan:
    """The plan for `device`: a GPU card (the one present, or `card` / the recipe's for a dry run on a machine
    without one), or the host's free memory."""
    from qconv.convert.device import cuda_available, free_bytes

    if device == "cpu":
        return device_plan(
            plan,
            config,
            recipe,
            device="cpu",
            samples=samples,
            seq_len=seq_len,
            capacity=free_bytes("cpu"),
            target="host memory (free now)",
        )
    name, total, tflops = card_target(card, recipe)
    if cuda_available() and card is None:
        import torch

        key = next((k for k, (n, _) in CARDS.items() if n.lower() in torch.cuda.get_device_name().lower()), None)
        name, total, tflops = torch.cuda.get_device_name(), free_bytes("cuda") + CUDA_OVERHEAD, FP32_TFLOPS.get(key)
    return device_plan(
        plan,
        config,
        recipe,
        device="cuda",
        samples=samples,
        seq_len=seq_len,
        capacity=total - CUDA_OVERHEAD,
        target=name,
        tflops=tflops,
    )


def plan_for(opts, recipe: Recipe, plan: Plan, config: dict, planning: bool = False) -> DevicePlan:
    """The plan for a build's options (build.pipeline.BuildOptions). A dry run plans for a card without one being
    present: `--device cuda`, or `auto` with `--card`, plans for the card; a build plans for the device it
    resolved to, with the memory free on it now."""
    from qconv.convert.device import cuda_available, resolve_device

    if planning:
        device = opts.device or "auto"
        device = "cuda" if device == "cuda" or (device == "auto" and (opts.card or cuda_available())) else "cpu"
    else:
        device = resolve_device(opts.device)
    cal = recipe.calibration
    return build_plan(
        plan,
        config,
        recipe,
        device=device,
        samples=opts.samples or cal.samples,
        seq_len=opts.seq_len or cal.seq_len,
        card=opts.card if planning else None,
    )
