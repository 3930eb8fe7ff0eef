"""One KV page in one file: the disk tier's format (no JAX).

The host tier (jaxserve.executor.kv_offload) writes a page it overwrites into a file
(`write_page`, from its host buffer) and the disk tier's bookkeeping (jaxserve.core.kv_disk)
reads it back (`read_page`) before the scheduler restores it. A file is

    magic b"JXKV" | format version u32 | hash length u32 | the page's chained hash |
    token count u32 | the page's token ids (i64 each) | payload length u64 | payload |
    blake2b-128 of everything before it

little-endian. A read checks all of it against what the caller expects (the salted chained hash
and the token ids the prefix cache holds, the page's byte size): a file that is short, altered,
of another version or another page is a miss, never a page restored. A file is written under a
temporary name and renamed, so a crash leaves no partial file under a page's name.
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

MAGIC = b"JXKV"
FORMAT_VERSION = 1
SUFFIX = ".kvpage"
_DIGEST = 16


def file_bytes(page_size: int, nbytes: int, hash_bytes: int = 16) -> int:
    """A page's file size: its header (the prefix cache's 16-byte hashes), payload and digest."""
    return len(MAGIC) + 8 + hash_bytes + 4 + 8 * page_size + 8 + nbytes + _DIGEST


def page_file(directory: str, page_hash: bytes) -> str:
    return os.path.join(directory, page_hash.hex() + SUFFIX)


def _header(page_hash: bytes, tokens: tuple[int, ...], nbytes: int) -> bytes:
    return b"".join((MAGIC, struct.pack("<II", FORMAT_VERSION, len(page_hash)), page_hash,
                     struct.pack("<I", len(tokens)), np.asarray(tokens, "<i8").tobytes(),
                     struct.pack("<Q", nbytes)))


def write_page(path: str, page_hash: bytes, tokens: tuple[int, ...], payload: np.ndarray) -> int:
    """Write the page's file (0600, atomically); the bytes written."""
    data = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
    head = _header(page_hash, tokens, data.nbytes)
    digest = hashlib.blake2b(head, digest_size=_DIGEST)
    digest.update(data)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(head)
        f.write(data)
        f.write(digest.digest())
    os.replace(tmp, path)
    return len(head) + data.nbytes + _DIGEST


def read_page(path: str, page_hash: bytes, tokens: tuple[int, ...], nbytes: int) -> bytes | None:
    """The page's payload when the file holds exactly this page, intact; else None."""
    head = _header(page_hash, tokens, nbytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            blob = f.read(len(head) + nbytes + _DIGEST + 1)
    except OSError:
        return None
    if len(blob) != len(head) + nbytes + _DIGEST or not blob.startswith(head):
        return None
    body = memoryview(blob)[:-_DIGEST]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != blob[-_DIGEST:]:
        return None
    return bytes(body[len(head):])
