"""A content-addressed, write-once blob store in a directory (``<run dir>/blobs``).

A blob is a byte string named by the hex sha256 of its bytes; it lives at
``<root>/<first two hex digits>/<the other 62>``. :meth:`BlobStore.put` writes the bytes to a
temporary file beside their final name, flushes them, then renames it into place, so a reader
never sees a partial blob; writing bytes that are already stored does nothing (same name, same
bytes), so concurrent writers of one blob (processes, or threads of one) are harmless: each writes
its own temporary file. :meth:`BlobStore.get` checks the digest
of what it reads; a missing or corrupt blob, or a malformed digest, is a :class:`BlobError` whose
message names the digest and the reason (the dead letter of a sample whose image is gone).
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from pathlib import Path

BLOBS_DIR = "blobs"
"""In a run's folder: its blob store."""

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobError(LookupError):
    """A blob that cannot be read: malformed digest, missing, or bytes that do not match it."""


def sha256_hex(data: bytes) -> str:
    """The hex sha256 of ``data`` (a blob's name)."""
    return hashlib.sha256(data).hexdigest()


def is_digest(name: str) -> bool:
    """Whether ``name`` is a blob name: 64 lowercase hex digits."""
    return bool(_DIGEST_RE.match(name))


def blob_dir_of(run_dir: str | Path) -> Path:
    """The blob store of the run in ``run_dir``: ``<run_dir>/blobs``."""
    return Path(run_dir) / BLOBS_DIR


def share_blobs(src: str | Path, dst: str | Path) -> int:
    """Put every blob of the store at ``src`` into the store at ``dst`` (hard links; copies across
    filesystems); blobs ``dst`` holds already are left alone. Returns how many were added."""
    import shutil

    added = 0
    for path in sorted(Path(src).glob("??/*")):
        digest = path.parent.name + path.name
        if not is_digest(digest):
            continue  # a writer's temporary file
        final = Path(dst) / path.parent.name / path.name
        if final.is_file():
            continue
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, final)
        except OSError:
            shutil.copyfile(path, final)
        added += 1
    return added


class BlobStore:
    """The blobs under ``root`` (created on the first :meth:`put`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        """Where the blob ``digest`` lives (whether or not it is there); ``BlobError`` if malformed."""
        if not is_digest(digest):
            raise BlobError(f"blob {digest!r}: not a sha256 hex digest (64 lowercase hex digits)")
        return self.root / digest[:2] / digest[2:]

    def has(self, digest: str) -> bool:
        """Whether the blob ``digest`` is stored."""
        return self.path(digest).is_file()

    def put(self, data: bytes) -> str:
        """Store ``data`` (once) and return its digest."""
        digest = sha256_hex(data)
        final = self.path(digest)
        if final.is_file():
            return digest
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return digest

    def get(self, digest: str) -> bytes:
        """The bytes of blob ``digest``; ``BlobError`` naming it when missing or corrupt."""
        path = self.path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlobError(f"blob {digest}: missing from the blob store {self.root}") from None
        except OSError as e:
            raise BlobError(f"blob {digest}: unreadable in {self.root}: {e.strerror or e}") from None
        if sha256_hex(data) != digest:
            raise BlobError(f"blob {digest}: corrupt in {self.root} (its bytes hash to {sha256_hex(data)})")
        return data
