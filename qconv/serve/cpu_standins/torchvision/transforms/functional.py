from torchvision import unavailable
from torchvision.transforms import InterpolationMode  # noqa: F401

pil_to_tensor = unavailable("transforms.functional.pil_to_tensor")
