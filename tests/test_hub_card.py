"""Issue 30, point 5: the Hub model card says how vLLM runs the artifact as its `requires` says: stock `vllm serve`
only when nothing there applies everywhere, the plugin's runtime when one does, `qconv serve` when no vLLM can."""

from __future__ import annotations

import pytest

from qconv.convert.requires import PLUGIN
from qconv.hub.push import model_card
from qconv.manifest import QUANTIZED_EMBEDDINGS, Requirement, read_manifest
from tests.hub_server import make_artifact

STOCK = "Or with vLLM (compressed-tensors is read natively)"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return read_manifest(make_artifact(tmp_path_factory.mktemp("card") / "art"))


def _card(manifest, requires):
    manifest.requires = requires
    return model_card(manifest, "me/art")


def test_no_requires_says_stock_vllm(manifest):
    card = _card(manifest, [])
    assert STOCK in card and "vllm serve me/art" in card and "## Requirements" not in card


def test_plugin_requirement_names_the_plugin_runtime(manifest):
    card = _card(manifest, [Requirement("int8 embed_tokens", PLUGIN, reason="r", vllm_feature=QUANTIZED_EMBEDDINGS)])
    assert STOCK not in card
    assert "vLLM 0.32 and the qconv-vllm plugin (`qconv runtime install`" in card and "vllm serve me/art" in card
    assert "stock vLLM cannot load it" in card


def test_scoped_requirements_keep_stock_vllm_and_say_their_scope(manifest):
    card = _card(
        manifest,
        [
            Requirement("8-bit weight-only layers (lm_head)", PLUGIN, reason="r", platform="cpu"),
            Requirement(
                "profile huge: kvarn_k4v2 KV cache", "qconv runtime or the KVarN build of vLLM", profile="huge"
            ),
        ],
    )
    assert STOCK in card
    assert "- 8-bit weight-only layers (lm_head) (cpu vLLM only): needs" in card
    assert "- profile huge: kvarn_k4v2 KV cache (profile huge only): needs" in card


def test_native_only_requirement_says_qconv_serve(manifest):
    card = _card(manifest, [Requirement("something", "qconv", reason="r")])
    assert "vllm serve" not in card and "vLLM cannot run this artifact" in card and "qconv serve me/art" in card
