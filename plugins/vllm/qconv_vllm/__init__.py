"""qconv-vllm: what stock vLLM lacks to run qconv artifacts as built, loaded by vLLM itself through the
`vllm.general_plugins` entry point in every vLLM process. It never imports qconv.

Each patch is tied to the vLLM versions it was written against (`TESTED`), and each target to its signature in one
table (patches.py): on another version, or a release that moved a target, `register()` stops vLLM with a message
naming the target and what to install, since a silently skipped patch would load a model with the wrong weights or
fail deep inside model loading."""

from __future__ import annotations

import logging
import os

# What the plugin adds, by the tokens qconv writes into an artifact's qconv.json `requires`
from qconv_vllm.features import FEATURES as FEATURES
from qconv_vllm.features import KVARN_PRESETS as KVARN_PRESETS

__version__ = "0.1.0"
TESTED = ("0.32",)  # vLLM major.minor series whose source these patches were read against
UNTESTED_ENV = "QCONV_VLLM_ALLOW_UNTESTED"

log = logging.getLogger("qconv_vllm")
_applied: list[str] = []


class UnsupportedVllm(RuntimeError):
    pass


def vllm_series(version: str) -> str:
    """'0.32.0+cpu' -> '0.32'."""
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2])


def check_version(version: str) -> None:
    if vllm_series(version) in TESTED or os.environ.get(UNTESTED_ENV) == "1":
        return
    raise UnsupportedVllm(
        f"qconv-vllm {__version__} patches vLLM {', '.join(s + '.x' for s in TESTED)}, but vLLM {version} is "
        f"installed. Install the tested vLLM with `qconv runtime install` (or pip install 'vllm=={TESTED[-1]}.*'), "
        f"or set {UNTESTED_ENV}=1 to try this vLLM anyway."
    )


def register() -> None:
    """Entry point (vllm.general_plugins). Idempotent: vLLM may call it more than once per process."""
    if _applied:
        return
    import vllm

    check_version(vllm.__version__)
    from qconv_vllm import embedding, kernels, kvarn, patches, rotation, tied_head, w4a8

    patches.check_all()  # every target, before the first patch: a moved one stops vLLM naming it and the version

    _applied.extend(embedding.apply())
    _applied.extend(tied_head.apply())
    _applied.extend(kernels.apply())
    _applied.extend(kvarn.apply())
    _applied.extend(w4a8.apply())
    _applied.extend(rotation.apply())
    log.info("qconv-vllm %s active on vLLM %s: %s", __version__, vllm.__version__, ", ".join(_applied))


def applied() -> list[str]:
    """Names of the patches in force in this process (for tests and `qconv runtime list`)."""
    return list(_applied)
