"""Fuzzing the files qconv reads (issue 34): qconv.json, config.json, recipe YAML and safetensors headers, with random
type swaps, deleted and unknown keys, truncation, huge numbers, long strings, links and YAML aliases. Seeded and
bounded in count; every case must end in success or one QconvError, never another exception, and the process's
peak RSS must stay within RSS_BOUND of where it started."""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from qconv.errors import QconvError

CASES = {"manifest": 160, "config": 60, "recipe": 120, "header": 160, "index": 120, "report": 60}
RSS_BOUND = 512 << 20  # bytes the peak RSS may grow by over all cases (ru_maxrss is in KiB on Linux)


def _leaf_paths(obj, path=()):
    """Every (path) into a JSON-like tree, containers included."""
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaf_paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            yield from _leaf_paths(v, (*path, i))


def _hostile_value(rng: random.Random):
    return rng.choice(
        [
            None,
            True,
            -1,
            0,
            10**30,
            -(10**30),
            10**400,
            1e308,
            float("inf"),
            float("nan"),
            -1e308,
            3.5,
            "",
            "x" * 100_000,
            "big",
            "../../etc/passwd",
            [],
            [1, "a", None],
            {},
            {"sha256": 1},
            [[[[[[]]]]]],
            {"a": {"b": {}}},
        ]
    )


def mutate_tree(data, rng: random.Random):
    """One to three random edits of a JSON-like tree: swap a value's type, delete or add a key, nest deeply."""
    data = copy.deepcopy(data)
    for _ in range(rng.randint(1, 3)):
        paths = list(_leaf_paths(data))
        path = rng.choice(paths)
        if not path:
            if rng.random() < 0.2:
                return _hostile_value(rng)
            continue
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        op = rng.random()
        if op < 0.6:
            parent[path[-1]] = _hostile_value(rng)
        elif op < 0.8 and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[rng.choice(["unknown", "x" * 1000, "__metadata__", "1"])] = _hostile_value(rng)
        else:
            parent[path[-1]] = [parent[path[-1]]] * 3
    return data


def as_text(data, rng: random.Random) -> bytes:
    """JSON text of `data`, sometimes cut short, sometimes with a byte flipped or a huge literal spliced in."""
    raw = json.dumps(data).encode()
    op = rng.random()
    if op < 0.15:
        return raw[: rng.randrange(len(raw))]
    if op < 0.2:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1 :]
    if op < 0.25:
        return raw.replace(b"1", b"9" * 5000, 1)  # an integer too long for int()
    if op < 0.28:
        return b"[" * 100_000 + b"]" * 100_000
    return raw


def _ends_well(fn) -> str:
    try:
        fn()
        return "ok"
    except QconvError:
        return "refused"


@pytest.fixture(scope="module")
def rss_start():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def _rss_within_bound(start: int) -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert peak - start < RSS_BOUND, f"peak RSS grew by {(peak - start) >> 20} MiB"


def test_fuzzed_manifests_end_in_success_or_one_error(tmp_path, rss_start):
    from qconv.artifact import Artifact
    from qconv.hub.verify import verify_artifact
    from tests.hub_server import make_artifact

    base = make_artifact(tmp_path / "base")
    good = json.loads((base / "qconv.json").read_text())
    rng, seen = random.Random(34), {"ok": 0, "refused": 0}
    for i in range(CASES["manifest"]):
        art = tmp_path / f"a{i}"
        shutil.copytree(base, art)
        (art / "qconv.json").write_bytes(as_text(mutate_tree(good, rng), rng))
        if i % 16 == 0:  # links: a listed file, or qconv.json itself, pointing at a device that never ends
            victim = rng.choice(["tokenizer.json", "qconv.json"])
            (art / victim).unlink()
            (art / victim).symlink_to("/dev/zero")

        def read(art=art):
            a = Artifact.open(art)
            _ = a.recipe, a.profiles, a.quality, a.default_profile
            verify_artifact(art).raise_for_problems()

        seen[_ends_well(read)] += 1
        shutil.rmtree(art)
    assert seen["refused"] > CASES["manifest"] // 2 and seen["ok"] > 0, seen
    _rss_within_bound(rss_start)


def test_fuzzed_model_configs_end_in_success_or_one_error(tiny_llama, tmp_path, rss_start):
    """config.json as the dry run reads it: the config reader, then the plan from headers and config."""
    from qconv.convert.layout import layout_model
    from qconv.convert.sources import read_config
    from qconv.modelfiles import check_weight_files
    from qconv.recipes.recipe import load_recipe

    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    good = json.loads((folder / "config.json").read_text())
    recipe = load_recipe("3090")
    rng, seen = random.Random(35), {"ok": 0, "refused": 0}
    for _ in range(CASES["config"]):
        (folder / "config.json").write_bytes(as_text(mutate_tree(good, rng), rng))
        seen[_ends_well(lambda: (layout_model(folder, read_config(folder), recipe), check_weight_files(folder)))] += 1
    assert seen["refused"] > 0 and seen["ok"] > 0, seen
    _rss_within_bound(rss_start)


def _recipe_text(data, rng: random.Random) -> str:
    text = yaml.safe_dump(data, sort_keys=False)
    op = rng.random()
    if op < 0.15:
        return text[: rng.randrange(len(text))]
    if op < 0.3:  # an anchor and its aliases, nested: refused before anything expands them
        return "x0: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\nx1: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" + text
    if op < 0.35:
        base = rng.choice(["../config.json", "'3090'", "[1, 2]", "nope.yaml", "{}", "/proc/self/environ", "/dev/zero"])
        return text + "\nextends: " + base + "\n"
    if op < 0.4:  # a control character YAML refuses
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(["\x01", "\x00", "\x1b", "\ufffe"]) + text[i:]
    return text


def test_fuzzed_recipes_end_in_success_or_one_error(tmp_path, rss_start):
    from qconv.recipes.recipe import load_recipe

    good = yaml.safe_load((Path(__file__).resolve().parents[1] / "qconv" / "recipes" / "3090.yaml").read_text())
    rng, seen = random.Random(36), {"ok": 0, "refused": 0}
    path = tmp_path / "r.yaml"
    for _ in range(CASES["recipe"]):
        try:
            path.write_text(_recipe_text(mutate_tree(good, rng), rng))
        except (yaml.YAMLError, RecursionError):  # a value YAML itself cannot write: nothing to load
            continue
        seen[_ends_well(lambda: load_recipe(str(path)).sha256)] += 1
    assert seen["refused"] > CASES["recipe"] // 2 and seen["ok"] > 0, seen
    _rss_within_bound(rss_start)


def _shard(header: dict, data: bytes, rng: random.Random) -> bytes:
    raw = as_text(header, rng)
    raw += b" " * (-len(raw) % 8)
    length = len(raw) if rng.random() > 0.1 else rng.choice([0, 2**63, len(raw) + 10**9, len(raw) - 3])
    out = struct.pack("<Q", length) + raw + data
    return out[: rng.randrange(len(out))] if rng.random() < 0.1 else out


def test_fuzzed_safetensors_headers_end_in_success_or_one_error(tiny_llama, tmp_path, rss_start):
    """The one header reader, and the dry run's tensor table built on it."""
    from qconv.convert.layout import tensor_table
    from qconv.modelfiles import check_weight_files

    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[0]
    blob = shard.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    good, data = json.loads(blob[8 : 8 + n]), blob[8 + n :]
    config = json.loads((folder / "config.json").read_text())
    rng, seen = random.Random(37), {"ok": 0, "refused": 0}
    for _ in range(CASES["header"]):
        header = mutate_tree(good, rng) if rng.random() > 0.1 else good  # some well-formed ones, to show they pass
        shard.write_bytes(_shard(header, data, rng))
        seen[_ends_well(lambda: (check_weight_files(folder), tensor_table(folder, config)))] += 1
    shard.unlink()
    shard.symlink_to("/dev/zero")  # a link to a device: refused, not read forever
    seen[_ends_well(lambda: check_weight_files(folder))] += 1
    assert seen["refused"] > CASES["header"] // 2 and seen["ok"] > 0, seen
    os.unlink(shard)
    _rss_within_bound(rss_start)


def test_fuzzed_indexes_end_in_success_or_one_error(tmp_path, rss_start):
    """The artifact index as `pull --index FILE` reads it (deep nesting, wrong types, location kinds and uris)."""
    from qconv.hub.index import Location, entry_for_artifact, index_from_dict, load_index
    from tests.hub_server import make_artifact

    art = make_artifact(tmp_path / "art")
    good = {"schema_version": 1, "artifacts": [entry_for_artifact(art, Location("url", "https://x/a")).__dict__]}
    good = json.loads(json.dumps(good, default=lambda o: o.__dict__))
    uris = ["file:///etc", "ftp://h/a", "relative/dir", "https://h/a", "/abs", "file://rel"]
    rng, seen = random.Random(38), {"ok": 0, "refused": 0}
    path = tmp_path / "idx.json"
    for _ in range(CASES["index"]):
        data = mutate_tree(good, rng)
        if rng.random() < 0.3 and isinstance(data, dict) and data.get("artifacts"):
            try:
                data["artifacts"][0]["location"] = {"kind": rng.choice(["url", "path"]), "uri": rng.choice(uris)}
            except (TypeError, IndexError, KeyError):
                pass
        path.write_bytes(as_text(data, rng))
        seen[_ends_well(lambda: load_index(str(path)))] += 1
    seen[_ends_well(lambda: index_from_dict(good, "good"))] += 1
    assert seen["refused"] > CASES["index"] // 2 and seen["ok"] > 0, seen
    _rss_within_bound(rss_start)


def test_fuzzed_reports_never_make_a_regression_pass_vacuously(tmp_path, rss_start):
    """report.json as `check --against` reads it: a report that reads has every compared metric in its range, and
    the regression verdicts against it are computed (a non-finite limit fails)."""
    import math

    from qconv.eval.gates import regressions
    from qconv.eval.record import EvalReport
    from qconv.eval.report import summary
    from qconv.manifest import METRIC_RANGES
    from qconv.recipes.sections import Regression
    from tests.eval_helpers import eval_report

    report = eval_report(0, 256, 0.02, True)
    good = json.loads(json.dumps(report.data))
    rng, seen = random.Random(39), {"ok": 0, "refused": 0}
    path = tmp_path / "r.json"
    for _ in range(CASES["report"]):
        data = copy.deepcopy(good)
        metric = rng.choice(list(METRIC_RANGES))
        data["weights"][metric] = _hostile_value(rng)
        path.write_bytes(as_text(mutate_tree(data, rng) if rng.random() < 0.3 else data, rng))

        def judge():
            recorded = summary(EvalReport.read(path))
            for k in METRIC_RANGES:
                v = getattr(recorded.weights, k) if recorded.weights else 0.0
                lo, hi = METRIC_RANGES[k]
                assert math.isfinite(v) and lo <= v <= hi, (k, v)
            for v in regressions(report, recorded, Regression()):
                assert v.passed == (math.isfinite(v.limit) and v.passed), v

        seen[_ends_well(judge)] += 1
    path.write_text(json.dumps(good))  # the untouched report reads and judges
    seen[_ends_well(judge)] += 1
    assert seen["refused"] > CASES["report"] // 4 and seen["ok"] > 0, seen
    _rss_within_bound(rss_start)
