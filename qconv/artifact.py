"""The typed artifact: `Artifact.open(path)` reads qconv.json once and hands every consumer (eval, kv plan, serve)
the recipe it was built with, its serving profiles, speculation, requirements and quality summary."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from qconv.errors import QconvError
from qconv.manifest import MANIFEST, Manifest, QualityReport, Requirement, read_manifest
from qconv.recipes.recipe import Recipe
from qconv.recipes.schema import from_dict
from qconv.recipes.sections import Profile, Speculative


@dataclass
class Artifact:
    path: Path
    manifest: Manifest

    @classmethod
    def open(cls, path: str | Path) -> Artifact:
        """The artifact at `path`; a clear error when the folder or its qconv.json is missing or malformed."""
        return cls(Path(path), read_manifest(path))

    @classmethod
    def find(cls, path: str | Path) -> Artifact | None:
        """The artifact at `path`, or None for a plain model folder (no qconv.json)."""
        return cls.open(path) if (Path(path) / MANIFEST).is_file() else None

    @cached_property
    def recipe(self) -> Recipe | None:
        """The recipe it was built with (None: the manifest records none); typed when first asked for. Keys another
        qconv version recorded and this one does not know are skipped with a warning; bad values are errors."""
        m = self.manifest
        if not m.recipe.resolved:
            return None
        return from_dict(
            Recipe, m.recipe.resolved, "", f"{self.path / MANIFEST} recipe ({m.recipe.name})", strict=False
        )

    @property
    def profiles(self) -> dict[str, Profile]:
        return self.manifest.profiles

    @property
    def default_profile(self) -> str:
        """The recipe's default profile, else the first. Read from the recorded recipe without typing all of it:
        serving needs no quantizer settings, which an artifact from another qconv version may name differently."""
        name = self.manifest.recipe.resolved.get("default_profile")
        return name if name in self.profiles else next(iter(self.profiles), "")

    @property
    def speculative(self) -> Speculative | None:
        return self.manifest.speculative

    @property
    def requires(self) -> list[Requirement]:
        return self.manifest.requires

    @property
    def quality(self) -> QualityReport | None:
        return self.manifest.quality

    def require_recipe(self) -> Recipe:
        if self.recipe is None:
            raise QconvError(
                f"{self.path / MANIFEST} records no recipe", where=str(self.path), fix="pass --recipe NAME_OR_PATH"
            )
        return self.recipe

    def profile(self, name: str | None = None) -> tuple[str, Profile]:
        return choose_profile(self.profiles, name or self.default_profile, self.path.name)


def choose_profile(profiles: dict[str, Profile], name: str, owner: str) -> tuple[str, Profile]:
    """(name, profile); an unknown name is an error listing the profiles `owner` has."""
    if name not in profiles:
        raise QconvError(
            f"unknown profile {name!r}",
            where="--profile",
            fix=f"profiles of {owner}: {', '.join(profiles) or '(none)'}",
        )
    return name, profiles[name]
