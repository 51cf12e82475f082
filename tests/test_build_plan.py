"""The resolved build plan (qconv/build/plan.py): every stage's cache key is derived from the plan fields the stage
declares it reads and its inputs, so changing one field changes exactly the keys of the stages that read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qconv.build.plan import STAGES, BuildPlan, fields_read_by, stage_reads
from qconv.recipes.recipe import load_recipe

INPUTS = {"source": "src-sha", "calibration": "cal-sha", "modules": [{"name": "m", "bits": 4}], "weights": {"a": "1"}}


def _plan() -> BuildPlan:
    recipe = load_recipe("3090")
    return BuildPlan(
        source=None,
        recipe=recipe,
        layout=None,
        device="cpu",
        compute_dtype=torch.float32,
        cpu_isa="avx2",
        stream=False,
        dataset="cal.txt",
        dataset_sha256="d" * 64,
        default_dataset="wikitext",
        split="train",
        samples=16,
        seq_len=512,
        seed=0,
        units=(),
        rotated=("model.layers.0.mlp.down_proj",),
        sensitivity="proxy",
        sensitivity_samples=8,
        budget_bytes=0,
        budget_label="0",
        budget_note="",
        quantizer=recipe.quantizer,
        schemes=dict(recipe.schemes),
        tied_embeddings=recipe.tied_embeddings,
        untie=False,
        tied=False,
        tools={"torch": "2"},
        max_shard_size="5GB",
        eval_text="held.txt",
        eval_text_id="e" * 64,
        quality=recipe.quality,
        gates=True,
    )


def _other(value):
    """A value of the same kind that differs from `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return "x"
    if isinstance(value, torch.dtype):
        return torch.bfloat16 if value != torch.bfloat16 else torch.float32
    if isinstance(value, (tuple, list)):
        return type(value)([*value, "x"])
    if isinstance(value, dict):
        return {**value, "x": 1}
    if dataclasses.is_dataclass(value):
        f = next(f for f in dataclasses.fields(value) if f.init)
        return dataclasses.replace(value, **{f.name: _other(getattr(value, f.name))})
    raise AssertionError(f"no other value for {value!r}")


def _keys(plan: BuildPlan, **inputs) -> dict[str, str]:
    return {s: plan.key(s, **{**INPUTS, **inputs}) for s in STAGES}


KEYED = [f for f in dataclasses.fields(BuildPlan) if f.compare]


@pytest.mark.parametrize("field", KEYED, ids=[f.name for f in KEYED])
def test_a_field_changes_exactly_the_keys_of_the_stages_that_read_it(field):
    base = _plan()
    changed = dataclasses.replace(base, **{field.name: _other(getattr(base, field.name))})
    before, after = _keys(base), _keys(changed)
    assert {s for s in STAGES if before[s] != after[s]} == set(stage_reads(field)), field.name


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_an_input_changes_the_key_of_each_stage_given_it(name):
    plan = _plan()
    before, after = _keys(plan), _keys(plan, **{name: _other(INPUTS[name])})
    assert all(before[s] != after[s] for s in STAGES)


def test_every_stage_reads_the_compute_and_what_it_is_told_to():
    """The fields whose change must reach a cached result: a stage that computes reads the device's arithmetic (the
    CPU's kernels, the compute dtype); calibration reads its size and seed; quantization the recipe's rounding."""
    for stage in STAGES:
        assert {"compute_dtype", "cpu_isa"} <= set(fields_read_by(stage)), stage
    assert {"samples", "seq_len", "seed", "dataset", "dataset_sha256"} <= set(fields_read_by("calibration"))
    assert {"quantizer", "schemes", "seed", "rotated", "device", "tools"} <= set(fields_read_by("quantization"))
    assert {"units", "rotated", "sensitivity"} <= set(fields_read_by("sensitivity"))
    assert {"eval_text_id", "quality", "device"} <= set(fields_read_by("quality"))


def test_the_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _plan().samples = 3  # type: ignore[misc]
