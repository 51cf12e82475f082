"""Prebuilt artifacts: registry index, verified resumable pulls into the cache, verify, push.

Import-light on purpose (no huggingface_hub here): `qconv serve NAME` calls resolve_artifact on every start.
"""

from qconv.hub.cache import resolve_artifact

__all__ = ["resolve_artifact"]
