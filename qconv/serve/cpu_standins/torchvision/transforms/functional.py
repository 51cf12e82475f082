from torchvision import _unavailable
from torchvision.transforms import InterpolationMode  # noqa: F401

pil_to_tensor = _unavailable("transforms.functional.pil_to_tensor")
