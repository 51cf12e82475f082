"""A family is its file: a fake family registered from a temporary file, with its own layer kinds (sliding window
every 3rd layer global), a stock-vLLM quantized embedding, a new role and a buffer restorer, reaches the KV
planner, the artifact's requirements, recipe validation and the streamed loader without any other file edited."""

from __future__ import annotations

import types

import pytest

import qconv.models as models_pkg
from qconv.models import family as family_mod

FAKE = """
from dataclasses import replace
from functools import partial

from qconv.models.family import interleaved_layer_types
from qconv.models.llama import FAMILY as LLAMA


def restore(module):
    if not hasattr(module, "fake_scale"):
        return False
    module.restored = True
    return True


FAMILY = replace(
    LLAMA,
    name="fakefam",
    model_types=("fakefam_text",),
    role_patterns=(*LLAMA.role_patterns, ("fake_router", r"\\.router$")),
    layer_types=partial(interleaved_layer_types, every_key="global_every", every=3, other="sliding_attention"),
    restore_buffers=restore,
    vllm_quantized_embed=("fakefam_text",),
)
"""


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
    (tmp_path / "fakefam.py").write_text(FAKE)
    monkeypatch.setattr(models_pkg, "__path__", [*models_pkg.__path__, str(tmp_path)])
    for f in (family_mod.registry, family_mod.all_role_patterns):
        f.cache_clear()
    yield family_mod.registry()["fakefam_text"]
    for f in (family_mod.registry, family_mod.all_role_patterns):
        f.cache_clear()


def config(n=6):
    return {
        "model_type": "fakefam_text",
        "architectures": ["FakeForCausalLM"],
        "num_hidden_layers": n,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "sliding_window": 32,
    }


def test_fake_family_layer_kinds_reach_the_kv_planner(fake_family):
    from qconv.kv.plan import model_dims
    from qconv.models import ModelSpec

    spec = ModelSpec.from_config(".", config())
    assert spec.family is fake_family
    d = model_dims(spec)
    assert (d.full_layers, d.sliding_layers, d.sliding_window) == (2, 4, 32)


def test_fake_family_embedding_needs_no_plugin_and_its_role_is_a_recipe_role(fake_family):
    from qconv.convert.requires import QUANTIZED_EMBEDDINGS, requirements
    from qconv.recipes import load_recipe

    rec = load_recipe("3090")
    embed = types.SimpleNamespace(role="embed", scheme="w8a16", bits=8)
    plan = types.SimpleNamespace(modules=[embed], model_type="fakefam_text", tied_embeddings=False)
    assert QUANTIZED_EMBEDDINGS not in {r.vllm_feature for r in requirements(rec, plan)}
    llama = types.SimpleNamespace(modules=[embed], model_type="llama", tied_embeddings=False)
    assert QUANTIZED_EMBEDDINGS in {r.vllm_feature for r in requirements(rec, llama)}
    assert "fake_router" in family_mod.all_roles()
    assert not list(rec.__class__.validate(types.SimpleNamespace(**{**vars(rec), "roles": {"fake_router": "bf16"}})))


def test_fake_family_restores_its_buffers_in_the_streamed_loader(fake_family):
    import torch

    from qconv.convert.stream import rebuild_meta_buffers

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fake_scale = 2.0
            self.register_buffer("scale", torch.empty((), device="meta"), persistent=False)

    model = torch.nn.Sequential(Scaled())
    rebuild_meta_buffers(model, fake_family)
    assert model[0].restored
