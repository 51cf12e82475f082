"""Hostile inputs, round 2 (a probe run as a hostile user would): one test per finding that is not about the cache
(tests/test_hub_faults.py) or a report (tests/test_eval_report_typed.py). Each failed on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qconv.errors import QconvError


@pytest.mark.parametrize("value, says", [("1", "the string '1'; it must be the number 1"), (True, "unsupported")])
def test_schema_version_messages_say_what_is_wrong(tmp_path, value, says):
    """ "schema_version '1' (this qconv reads 1)" left the reader puzzled: the string is named as a string."""
    from qconv.hub.index import index_from_dict
    from qconv.manifest import Manifest

    with pytest.raises(QconvError) as e:
        Manifest.from_dict({"schema_version": value})
    assert says in str(e.value)
    if value == "1":
        with pytest.raises(QconvError) as e:
            index_from_dict({"schema_version": value, "artifacts": []}, "idx.json")
        assert "index schema_version is the string '1'" in str(e.value)


def _published(tmp_path: Path, edit) -> Path:
    """The hub's tiny artifact, edited by `edit(folder)` and re-hashed: what a hostile publisher serves (the hashes
    match, so only the content checks can refuse it)."""
    from qconv.manifest import hash_artifact_files, read_manifest
    from tests.hub_server import make_artifact

    art = make_artifact(tmp_path / "art")
    cfg = json.loads((art / "config.json").read_text())
    (art / "config.json").write_text(json.dumps({**cfg, "vocab_size": 64, "hidden_size": 256}))
    edit(art)
    m = read_manifest(art)
    m.files = hash_artifact_files(art)
    m.write(art)
    return art


def _rename_in_header(folder: Path, old: str, new: str) -> None:
    from tests.hub_server import BIG

    assert len(old) == len(new)
    blob = (folder / BIG).read_bytes()
    assert blob.count(old.encode()) == 1
    (folder / BIG).write_bytes(blob.replace(old.encode(), new.encode()))


VERBS = {
    "generate": lambda art: ["generate", art, "--prompt", "hi", "--max-tokens", "2"],
    "eval": lambda art: ["eval", art, "--text", art / "config.json"],
    "check": lambda art: ["check", art, "--text", art / "config.json"],
    "serve": lambda art: ["serve", art, "--print-command"],
}


@pytest.mark.parametrize("verb", VERBS)
def test_a_tensor_renamed_in_the_header_is_one_error(tmp_path, verb):
    """One tensor renamed in a valid header (`…weight_shape` -> `xodel…`): generate and serve used to fail with
    `TypeError: 'NoneType' object is not subscriptable`, eval and check with `RuntimeError: unflatten`."""
    from tests.cli_helpers import run

    name = "model.layers.0.mlp.down_proj.weight_shape"
    art = _published(tmp_path, lambda a: _rename_in_header(a, name, "x" + name[1:]))
    r = run(*VERBS[verb](art))
    assert r.exit_code == 2 and "comes without" in r.output and name in r.output, r.output


@pytest.mark.parametrize("verb", VERBS)
def test_a_vocab_of_1e12_is_refused_before_allocating(tmp_path, verb):
    """config.json `vocab_size: 1e12`: serve and generate failed with a size-mismatch RuntimeError, eval tried to
    allocate 1.15e15 bytes. Now every verb refuses it from the headers, before anything is allocated."""
    from tests.cli_helpers import run

    def edit(art):
        cfg = json.loads((art / "config.json").read_text())
        (art / "config.json").write_text(json.dumps({**cfg, "vocab_size": 10**12}))

    art = _published(tmp_path, edit)
    r = run(*VERBS[verb](art))
    assert r.exit_code == 2 and "vocab_size 1000000000000" in r.output and "config.json" in r.output, r.output


def test_vocab_must_match_the_embedding_rows(tmp_path):
    from qconv.modelfiles import check_weight_files
    from tests.hub_server import SMALL

    def edit(art):
        from safetensors.numpy import save_file

        save_file({"model.embed_tokens.weight": __import__("numpy").zeros((64, 256), "float16")}, str(art / SMALL))
        cfg = json.loads((art / "config.json").read_text())
        (art / "config.json").write_text(json.dumps({**cfg, "vocab_size": 65}))

    with pytest.raises(QconvError, match="vocab_size 65 does not match the 64 rows"):
        check_weight_files(_published(tmp_path, edit))


ROT = "model.layers.0.mlp.down_proj.v_input.weight"


def _with_rotation(block) -> callable:
    def edit(art):
        import torch
        from safetensors.torch import save_file

        from tests.hub_server import SMALL

        save_file({"lm_head.weight": torch.zeros(64, 256, dtype=torch.float16), ROT: block}, str(art / SMALL))

    return edit


def _hadamard(n: int):
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(torch.bfloat16)


@pytest.mark.parametrize("damage", ["nan", "1e300", "not orthogonal", "not square"])
def test_a_damaged_rotation_block_is_refused_at_load(tmp_path, damage):
    """The rotation block filled with NaN or scaled by 1e300: `generate` exited 0 and printed nothing. Now every
    verb refuses a block that is not finite, square and orthogonal, before loading."""
    import torch

    from qconv.modelfiles import check_weight_files
    from tests.cli_helpers import run

    good = _hadamard(64)
    check_weight_files(_published(tmp_path / "good", _with_rotation(good)))  # a real ±1 block passes
    block = {
        "nan": torch.full((64, 64), float("nan")),
        "1e300": good.double() * 1e300,
        "not orthogonal": good.float() + torch.eye(64),
        "not square": good[:32].contiguous(),
    }[damage]
    art = _published(tmp_path / "bad", _with_rotation(block))
    r = run("generate", art, "--prompt", "hi", "--max-tokens", "2")
    assert r.exit_code == 2 and f"rotation block {ROT!r}" in r.output and "fix:" in r.output, r.output
    for verb in ("eval", "serve"):
        assert run(*VERBS[verb](art)).exit_code == 2


@pytest.mark.parametrize("tcfg", ["x", {"config_groups": {"v": {"type": "hadamard", "apply": "x"}}}])
def test_a_malformed_transform_config_is_one_error(tmp_path, tcfg):
    """`quantization_config.transform_config: "x"` (or `apply: "x"`): a pydantic ValidationError traceback."""
    from qconv.convert.rotation import input_rotations
    from tests.cli_helpers import run

    with pytest.raises(QconvError, match="transform_config.* malformed|transform_config is not a mapping"):
        input_rotations({"transform_config": tcfg}, {}, {}, "config.json")

    def edit(art):
        cfg = json.loads((art / "config.json").read_text())
        cfg["quantization_config"]["transform_config"] = tcfg
        (art / "config.json").write_text(json.dumps(cfg))

    art = _published(tmp_path, edit)
    r = run("generate", art, "--prompt", "hi", "--max-tokens", "2")
    assert r.exit_code == 2 and "transform_config" in r.output, r.output


def test_a_requires_token_nobody_knows_is_refused_by_serve(tmp_path):
    """A `requires` entry naming an unknown feature was ignored by native serve, and `serve --print-command` printed
    a vLLM command line for it."""
    from qconv.manifest import Requirement
    from tests.cli_helpers import run

    def edit(art):
        from qconv.manifest import read_manifest

        m = read_manifest(art)
        m.requires = [Requirement("teleportation", "a future plugin", vllm_feature="teleport")]
        m.write(art)

    art = _published(tmp_path, edit)
    for args in (["--backend", "native"], ["--print-command"]):
        r = run("serve", art, *args)
        assert r.exit_code == 2 and "requires 'teleport'" in r.output and "does not know" in r.output, r.output
    r = run("serve", art, "--print-command", "--vllm-feature", "teleport")  # the user vouches for their vLLM
    assert r.exit_code == 0 and "-m qconv_vllm.frontdoor --model" in r.output, r.output  # vLLM behind the plugin's door


@pytest.mark.parametrize("verb", ["generate", "eval"])
def test_unreadable_tokenizer_files_are_one_error(tmp_path, verb):
    """A tokenizer.json transformers cannot read (here: no `added_tokens`) was a KeyError traceback from inside
    transformers in generate and eval."""
    from tests.cli_helpers import run

    art = _published(tmp_path, lambda a: None)  # make_artifact's tokenizer.json is such a file
    r = run(*VERBS[verb](art), *(["--reference", art] if verb == "eval" else []))
    assert r.exit_code == 2 and "cannot read the tokenizer" in r.output and str(art) in r.output, r.output
