"""Image blobs: decode their bytes, and turn images into a vision processor's inputs.

:func:`decode_image` opens PNG/JPEG/... bytes with Pillow as an RGB image; bytes that are not an
image are a :class:`blobs.BlobError` naming the digest and why (a sample's dead-letter reason).
:func:`pixel_inputs` runs a Hugging Face image processor (Qwen2-VL's) over a list of images:
``pixel_values`` (patches, features) and ``image_grid_thw`` (images, 3), the same for the engine
and the trainer so both feed the model identical pixels.
"""

from __future__ import annotations

import io
from typing import Any

from blobs.store import BlobError, sha256_hex


def encode_png(image: Any) -> bytes:
    """A Pillow image as PNG bytes (deterministic for the same pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def decode_image(data: bytes, digest: str = "") -> Any:
    """``data`` as an RGB Pillow image; ``BlobError`` naming the blob when it is not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        name = digest or sha256_hex(data)
        raise BlobError(f"blob {name}: not a decodable image ({type(e).__name__}: {e})") from None


def pixel_inputs(image_processor: Any, images: list[Any]) -> tuple[Any, Any]:
    """``(pixel_values, image_grid_thw)`` of ``images`` through ``image_processor`` (torch tensors:
    (patches, features) float32 and (len(images), 3) long)."""
    enc = image_processor(images=images, return_tensors="pt")
    return enc["pixel_values"], enc["image_grid_thw"]
