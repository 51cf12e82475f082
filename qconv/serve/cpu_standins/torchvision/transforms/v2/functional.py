from torchvision import unavailable


def __getattr__(name):
    return unavailable(f"transforms.v2.functional.{name}")
