"""Image input through the Qwen3.8 vision tower (`--vision`).

- `image_io`: image sources (data URIs, bytes, opt-in local files) -> Pillow images, with request limits
- `preprocess`: Pillow image -> pixel_values [patches, C*tp*p*p] + grid (t, h, w) (the HF processor's math)
- `tower`: the vision transformer over the artifact's `visual.*` tensors -> merged vision tokens
- `positions`: 3-axis MRoPE positions of an image prompt and the decode rope delta
- `chat_parts`: the image parts of OpenAI-style chat messages (URLs + field paths for errors)
- `prompt`: `VisionRuntime` (all of the above for one artifact) and `VisionPrompt` (per-sequence
  model arguments)
Every user-facing failure raises `VisionError` (a `NinferError`) with a one-line message.
"""
from .chat_parts import image_urls
from .errors import VisionError
from .image_io import ImageLimits, decode_image, load_image, load_images, read_source
from .positions import decode_positions, mrope_positions, placeholder_runs
from .preprocess import PreprocessConfig, num_image_tokens, preprocess_image, preprocess_images, smart_resize
from .prompt import VisionPrompt, VisionRequest, VisionRuntime
from .tower import VisionTower

__all__ = ["image_urls", "VisionError", "ImageLimits", "decode_image", "load_image", "load_images", "read_source",
           "decode_positions", "mrope_positions", "placeholder_runs", "PreprocessConfig", "num_image_tokens",
           "preprocess_image", "preprocess_images", "smart_resize", "VisionPrompt", "VisionRequest", "VisionRuntime",
           "VisionTower"]
