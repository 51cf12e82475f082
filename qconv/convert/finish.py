"""Finishing an artifact folder: the MTP head the loaders skip, the shard index, and the manifest (its one writer)."""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath

from qconv.fsutil import sha256_file
from qconv.manifest import (
    MANIFEST,
    CalibrationInfo,
    FileEntry,
    Manifest,
    ModuleDecision,
    RecipeInfo,
    SourceInfo,
    hash_artifact_files,
    tool_versions,
)
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)

MTP_SHARD = "model-mtp.safetensors"
IMPORT_RECIPE = "import"  # the recipe name a plain lossless import (`qconv convert quantized`) records


def copy_mtp(source: Path, out: Path) -> int:
    """transformers drops `mtp.*` on load; copy those tensors verbatim into their own shard and index them, so
    vLLM finds them for MTP speculation. Returns how many tensors were copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for shard in sorted(out.glob("*.safetensors")):  # llmcompressor may have copied them already
        with safe_open(shard, "pt") as f:
            if any(k.startswith("mtp.") for k in f.keys()):
                return 0
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                if k.startswith("mtp."):
                    tensors[k] = f.get_tensor(k)
    if not tensors:
        return 0
    save_file(tensors, out / MTP_SHARD, metadata={"format": "pt"})
    write_index(out)
    return len(tensors)


def write_index(out: Path) -> None:
    """(Re)write model.safetensors.index.json to cover every shard: vLLM loads only the files the index names."""
    from safetensors import safe_open

    weight_map, total = {}, 0
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                weight_map[k] = shard.name
        total += shard.stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(source: Path, out: Path) -> None:
    """Tokenizer and chat template files the model save did not write."""
    import shutil

    for p in source.iterdir():
        if p.is_file() and (
            p.name.startswith("tokenizer")
            or p.name
            in (
                "chat_template.jinja",
                "special_tokens_map.json",
                "vocab.json",
                "merges.txt",
                "preprocessor_config.json",
            )
        ):
            if not (out / p.name).exists():
                shutil.copy2(p, out / p.name)


def finalize(out: Path, manifest: Manifest, changed: tuple[str, ...] | None = None) -> Manifest:
    """Hash the artifact's files into the manifest and write it. `changed`: only these files were added or
    rewritten since the last finalize (the quality reports), so only they are hashed again."""
    if changed is None:
        manifest.files = hash_artifact_files(out)
    else:
        files = dict(manifest.files)
        for name in changed:
            if (out / name).is_file():
                files[name] = FileEntry(sha256_file(out / name), (out / name).stat().st_size)
        manifest.files = {k: files[k] for k in sorted(files, key=lambda k: PurePosixPath(k).parts)}
    manifest.write(out)
    return manifest


def write_manifest(
    out: Path,
    source: SourceInfo,
    recipe: Recipe | None,
    modules: list[ModuleDecision],
    *,
    requires: list,
    build: dict,
    calibration: CalibrationInfo | None = None,
    selection: dict | None = None,
    tools: dict | None = None,
) -> Manifest:
    """The one writer of an artifact's qconv.json (a build from full precision, one from a quantized checkpoint, a
    lossless import): the recipe's record, profiles and speculation (`recipe` None: a plain import), the module
    decisions and what was built, "unchecked" until a quality report says otherwise; hashed and written into `out`
    (finalize)."""
    info = (
        RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict())
        if recipe is not None
        else RecipeInfo(name=IMPORT_RECIPE, sha256="", resolved={})
    )
    manifest = Manifest(
        source=source,
        recipe=info,
        modules=modules,
        calibration=calibration,
        profiles=dict(recipe.profiles) if recipe is not None else {},
        speculative=recipe.speculative if recipe is not None else None,
        requires=requires,
        selection=selection,
        tools=tools if tools is not None else tool_versions(),
        status="unchecked",
        build=build,
    )
    return finalize(out, manifest)


__all__ = ["MANIFEST", "copy_mtp", "write_index", "copy_side_files", "finalize", "write_manifest"]
