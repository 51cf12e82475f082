"""Input rotations of a compressed-tensors checkpoint (llm-compressor's QuIP "v" transforms, recorded in config.json's
`transform_config`). A rotated Linear stores W' = W·V (then rounded) and computes y = (x·V)·W'ᵀ, V orthogonal and
block-diagonal; vLLM turns the input online. qconv's engine and evaluation read weights dense, so they fold V back
into the dequantized weight, W'·Vᵀ: the same product without a runtime transform."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qconv.calibrate.sensitivity import turned
from qconv.errors import QconvError
from qconv.modelfiles import ROTATION_STORED, transform_config
from qconv.recipes.sections import KEEP

log = logging.getLogger(__name__)

STORED = ROTATION_STORED  # `<module>.<scheme>_input.weight`: the block of one scheme, stored once per size


@dataclass(frozen=True)
class InputRotation:
    block: torch.Tensor  # [b, b] as stored: ±1 entries, unnormalized (compressed-tensors divides by sqrt(b))
    inverse: bool

    def matrix(self) -> torch.Tensor:
        """V's block as applied to the input (x·V, one block per `b` input features), float64, orthogonal."""
        b = self.block.shape[0]
        return (self.block.T if self.inverse else self.block).double() / math.sqrt(b)

    def fold(self, weight: torch.Tensor) -> torch.Tensor:
        """The dense weight that computes (x·V)·weightᵀ from x itself: weight·Vᵀ, block by block, in float64."""
        return turned(weight.double(), self.matrix().T).to(weight.dtype)


def quip_block(size: int) -> torch.Tensor:
    """The block llm-compressor's QuIPModifier builds for `random-hadamard` (compressed-tensors' random Hadamard
    matrix from a freshly made generator: its default seed), normalized: what the build will turn a weight by."""
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix

    return random_hadamard_matrix(size, torch.float64, torch.device("cpu"), torch.Generator()) / math.sqrt(size)


def rotated_modules(modules, recipe) -> list[str]:
    """The Linears the recipe's rotation turns: every quantized Linear of its roles whose in_features the rotation's
    block divides; none without a rotation."""
    rot = recipe.quantizer.rotation
    if rot is None:
        return []
    out, skipped = [], []
    for m in modules:
        if m.scheme == KEEP or m.role not in rot.roles:
            continue
        (out if m.shape[-1] % rot.block_size == 0 else skipped).append(m.name)
    if skipped:
        log.info("rotation: block %d does not divide %d Linears' inputs, left unrotated", rot.block_size, len(skipped))
    return out


def selection_rotations(rotated, recipe) -> dict[str, torch.Tensor]:
    """module name -> the block its input will be turned by, for the `rotated` modules (rotated_modules): the
    selection scores each unit's rounding as the build will round it."""
    if not rotated:
        return {}
    block = quip_block(recipe.quantizer.rotation.block_size).float()
    return dict.fromkeys(rotated, block)


def is_rotation_tensor(name: str) -> bool:
    return name.endswith(STORED)


def input_rotations(
    qcfg: dict | None, linears: Mapping[str, int], stored: Mapping[str, torch.Tensor], where: str = ""
) -> dict[str, InputRotation]:
    """module name -> its input rotation, for the Linears in `linears` (name -> in_features) that the checkpoint's
    transform_config rotates. `stored`: the checkpoint's rotation tensors (any mapping that holds them). Transforms
    qconv cannot fold (output-side, per-module permutations, embeddings) are refused rather than ignored: the
    weights would be read wrong."""
    tcfg = (qcfg or {}).get("transform_config")
    if not tcfg:
        return {}
    from compressed_tensors.utils.match import match_name

    config = transform_config(tcfg, where)
    out: dict[str, InputRotation] = {}
    for sname, scheme in config.config_groups.items():
        for args in scheme.apply:
            if not args.is_online():
                continue  # the weight side is in the stored weights already
            if args.location != "input" or scheme.randomize:
                raise QconvError(
                    f"transform {sname!r}: online {args.location} transforms"
                    + (" with per-module permutations" if scheme.randomize else "")
                    + " cannot be read by qconv (it folds input rotations only)",
                    where=where,
                    fix="build with the recipe's quantizer.rotation (input rotations), or serve the checkpoint in vLLM",
                )
            for mod, k in linears.items():
                hit = any(t == "Linear" or match_name(mod, t) for t in args.targets)
                if not hit or any(match_name(mod, i) for i in args.ignore):
                    continue
                if mod.endswith("embed_tokens"):
                    raise QconvError(f"transform {sname!r} rotates the embedding {mod}", where=where)
                out[mod] = InputRotation(_block(stored, mod, sname, scheme.head_dim or k, where), args.inverse)
    return out


def _block(stored: Mapping[str, torch.Tensor], mod: str, sname: str, size: int, where: str) -> torch.Tensor:
    """A module's rotation block: its own stored tensor, else the one of the same scheme and size stored for another
    module (safetensors keeps one copy of the tensor all of them share)."""
    own = stored.get(f"{mod}.{sname}{STORED}")
    if own is not None:
        return own
    suffix = f".{sname}{STORED}"
    for name, t in stored.items():
        if name.endswith(suffix) and t.shape == (size, size):
            return t
    raise QconvError(
        f"{mod}: its {size}x{size} rotation ({sname!r}) is not stored in the checkpoint",
        where=where,
        fix="the checkpoint is incomplete; rebuild or re-download it",
    )


def fold_rotations(
    qcfg: dict | None, tensors: dict[str, torch.Tensor], stored: Mapping[str, torch.Tensor] | None = None, where=""
) -> dict[str, torch.Tensor]:
    """`tensors` (dense) with every rotated Linear's weight folded and the rotation tensors dropped. `stored`: where
    the rotation tensors are when `tensors` is part of a checkpoint (default: `tensors`)."""
    linears = {k[: -len(".weight")]: t.shape[1] for k, t in tensors.items() if k.endswith(".weight") and t.dim() == 2}
    rotations = input_rotations(qcfg, linears, tensors if stored is None else stored, where)
    out = {k: t for k, t in tensors.items() if not is_rotation_tensor(k)}
    for mod, rot in rotations.items():
        out[f"{mod}.weight"] = rot.fold(out[f"{mod}.weight"])
    return out


def stored_rotations(files) -> dict[str, torch.Tensor]:
    """The rotation tensors of a checkpoint's safetensors shards (a few small matrices)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({n: sf.get_tensor(n) for n in sf.keys() if is_rotation_tensor(n)})
    return out
