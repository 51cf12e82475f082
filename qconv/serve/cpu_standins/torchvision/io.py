import enum

from torchvision import unavailable


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


decode_image = unavailable("io.decode_image")
read_video = unavailable("io.read_video")
