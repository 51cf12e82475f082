"""Typed recipes: which scheme each module role gets, KV profiles, speculation and quality gates; loaded from a
built-in name or a YAML path, with `extends:` chains."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml

from qconv.errors import QconvError
from qconv.fsutil import sha256_json
from qconv.models.family import all_roles
from qconv.recipes.schema import from_dict, shorten, to_dict
from qconv.recipes.sections import (
    KEEP,
    Calibration,
    Card,
    Profile,
    Quality,
    Quantizer,
    Scheme,
    SelectionRules,
    Speculative,
)

RECIPE_CAP = 1 << 20  # bytes; a recipe is a few KB


@dataclass
class Recipe:
    name: str
    description: str
    card: Card
    schemes: dict[str, Scheme]
    roles: dict[str, str]  # role -> scheme name or "bf16"
    quantizer: Quantizer = field(default_factory=Quantizer)
    # A model whose lm_head is tied to embed_tokens: keep one shared copy (embed's scheme; the runtime must run a
    # tied quantized head), or untie so lm_head carries its own scheme (a second copy, reported in the plan).
    tied_embeddings: Literal["keep", "untie"] = "untie"
    calibration: Calibration = field(default_factory=Calibration)
    selection: SelectionRules = field(default_factory=SelectionRules)
    profiles: dict[str, Profile] = field(default_factory=dict)
    default_profile: str = "fast"
    speculative: Speculative = field(default_factory=Speculative)
    quality: Quality = field(default_factory=Quality)

    def validate(self):
        for role, scheme in self.roles.items():
            if role not in all_roles():
                yield f"roles.{role}", f"unknown role {role!r}; roles: {', '.join(all_roles())}"
            elif scheme != KEEP and scheme not in self.schemes:
                yield f"roles.{role}", f"unknown scheme {scheme!r}; defined schemes: {', '.join([KEEP, *self.schemes])}"
        by_label: dict[str, Scheme] = {}
        for name, sc in self.schemes.items():  # a decision records the label, group size and symmetric, nothing else
            other = by_label.setdefault(sc.label, sc)
            if other is not sc and (
                other.activations != sc.activations or other.weights.strategy != sc.weights.strategy
            ):
                yield (
                    f"schemes.{name}",
                    (
                        f"shares the label {sc.label} with another scheme but differs in more "
                        "than group_size and symmetric; schemes of one bit width may differ in "
                        "those only"
                    ),
                )
        if self.selection.scheme not in self.schemes:
            yield "selection.scheme", f"unknown scheme {self.selection.scheme!r}; defined: {', '.join(self.schemes)}"
        for step in self.selection.steps:
            if step not in self.schemes or step == self.selection.scheme:
                yield (
                    "selection.steps",
                    (f"step {step!r} is not a scheme other than selection.scheme; defined: {', '.join(self.schemes)}"),
                )
        if self.profiles and self.default_profile not in self.profiles:
            yield "default_profile", f"{self.default_profile!r} is not a profile; profiles: {', '.join(self.profiles)}"

    def scheme_for(self, role: str) -> str:
        return self.roles.get(role, KEEP)

    def to_dict(self) -> dict:
        return to_dict(self)

    @property
    def sha256(self) -> str:
        return sha256_json(self.to_dict())


def builtin_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("qconv.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name (`3090`) or a user's YAML file by path. `extends: NAME_OR_PATH` at the top takes
    that recipe and overrides it: mappings merge key by key, anything else is replaced, and `key: null` over a
    mapping removes it (e.g. a profile), so a variant states only what differs from its base."""
    data, source = _recipe_data(name_or_path, ())
    return from_dict(Recipe, data, "", source)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if v is None and isinstance(base.get(k), dict):
            out.pop(k)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            out[k] = _merge(base[k], v)
        else:
            out[k] = v
    return out


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without anchors and aliases: nine nested aliases in a 500-byte file expand to gigabytes once
    anything walks the value, and no recipe needs them (`extends:` shares settings instead)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise QconvError(
                f"recipe uses a YAML alias (*{event.anchor}) at line {event.start_mark.line + 1}",
                where=self.name,
                fix="write the value out, or share settings with `extends:`",
            )
        return super().compose_node(parent, index)


def _parse_recipe(text: str, source: str):
    try:  # the reader refuses control characters as it is made: inside the try, so that is one error too
        loader = _NoAliasLoader(text)
    except yaml.reader.ReaderError as e:
        raise QconvError(
            f"recipe holds a control character ({chr(e.character)!r}) at character {e.position}, which YAML refuses",
            where=source,
            fix="remove it: a recipe is plain text",
        ) from e
    loader.name = source
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise QconvError(
            f"recipe is not valid YAML: {shorten(str(e), 300)}", where=source, fix="fix the YAML syntax"
        ) from e
    except RecursionError as e:
        raise QconvError("recipe is nested too deeply", where=source, fix="fix the YAML") from e
    finally:
        loader.dispose()


def _recipe_data(name_or_path: str, chain: tuple[str, ...]) -> tuple[dict, str]:
    text, source = _recipe_text(name_or_path)
    data = _parse_recipe(text, source)
    if chain and not isinstance(data, dict):
        raise QconvError(
            f"`extends:` names {source}, which is not a recipe (a YAML mapping); it holds a {type(data).__name__}",
            where=f"{chain[-1]}: extends",
            fix="name a recipe or a recipe's YAML path",
        )
    if not isinstance(data, dict) or "extends" not in data:
        return data, source
    base = data.pop("extends")
    if not isinstance(base, (str, int)) or isinstance(base, bool):
        raise QconvError(
            f"bad extends: {shorten(base)}", where=f"{source}: extends", fix="name a recipe or a YAML path"
        )
    base = str(base)
    if base.endswith((".yaml", ".yml")) and not Path(base).is_absolute() and Path(source).is_file():
        base = str(Path(source).parent / base)  # a user's variant names its base relative to itself
    chain = (*chain, str(Path(source).resolve()) if Path(source).is_file() else name_or_path)
    key = str(Path(base).resolve()) if Path(base).is_file() else base
    if key in chain:
        raise QconvError(
            f"recipes extend each other in a cycle: {' -> '.join([*chain, key])}",
            where=f"{source}: extends",
            fix="break the cycle",
        )
    parent, _ = _recipe_data(base, chain)
    return _merge(parent, data), source


def _recipe_text(name_or_path: str) -> tuple[str, str]:
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise QconvError(f"recipe file not found: {p}", where="--recipe", fix="check the path")
        with open(p, "rb") as f:  # at most the cap: a /proc file says it is 0 bytes long and may not be
            raw = f.read(RECIPE_CAP + 1)
        if len(raw) > RECIPE_CAP:
            raise QconvError(
                f"recipe file is over {RECIPE_CAP} bytes; a recipe is a few KB",
                where=str(p),
                fix="pass a recipe YAML file",
            )
        try:
            text, source = raw.decode(), str(p)
        except UnicodeDecodeError as e:
            raise QconvError(
                "recipe is not a text file (not UTF-8)", where=str(p), fix="pass a recipe YAML file"
            ) from e
    else:
        res = resources.files("qconv.recipes") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise QconvError(
                f"unknown recipe {name_or_path!r}",
                where="--recipe",
                fix=f"use one of {', '.join(builtin_recipes())} (see `qconv recipes list`) or a path to a YAML file",
            )
        text, source = res.read_text(), f"recipe {name_or_path}"
    return text, source
