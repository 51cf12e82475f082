"""Model families: the ModelSpec read once from a model folder, the family registry (one file per family) and the
plain-PyTorch blocks our engine builds its models from."""

from qconv.models.family import Family, family_for, layer_index, registry
from qconv.models.spec import ModelSpec

__all__ = ["Family", "ModelSpec", "family_for", "layer_index", "registry"]
