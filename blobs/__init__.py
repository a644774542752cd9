"""rollstream: blobs — a run's content-addressed blob store (images of visual tasks).

Large payloads (a task's image bytes) stay off the Kafka topics: they are written once to the
run's blob store under the sha256 of their bytes, and events carry only the hex digests. Any
service of the run reads them back by digest (:mod:`blobs.store`); :mod:`blobs.images` decodes
image blobs and turns them into a vision processor's inputs. It imports nothing of ours.
"""

from blobs.images import decode_image, encode_png, pixel_inputs
from blobs.store import BLOBS_DIR, BlobError, BlobStore, blob_dir_of, is_digest, sha256_hex, share_blobs

__all__ = [
    "BLOBS_DIR",
    "BlobError",
    "BlobStore",
    "blob_dir_of",
    "decode_image",
    "encode_png",
    "is_digest",
    "pixel_inputs",
    "sha256_hex",
    "share_blobs",
]
