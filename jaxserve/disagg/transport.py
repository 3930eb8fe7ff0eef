"""The KV pages' wire format between a prefill server and a decode server.

A frame: MAGIC, the header's length (u32, big-endian), the header (JSON: request id, layers,
pages, the page's shape and dtype, page size), the pages' bytes ([layers, pages, *page], C order)
and a blake2b-256 digest of everything before it. The reader bounds the header, checks that the
layout is its own (same model, dtype and page size on both sides) and that there are no more
pages than the prompt can hit, and checks the length and digest before a byte is used.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from jaxserve.core.kv_transfer import KVLayout
from jaxserve.errors import PrefillFailed

MAGIC = b"JXKV\x01"
MAX_HEADER_BYTES = 4096
_DIGEST_BYTES = 32
CONTENT_TYPE = "application/x-jaxserve-kv"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def encode(request_id: str, layout: KVLayout, pages: np.ndarray) -> bytes:
    header = json.dumps({"request_id": request_id, "num_layers": layout.num_layers,
                         "num_pages": int(pages.shape[1]), "page_shape": list(layout.page_shape),
                         "dtype": layout.dtype, "page_size": layout.page_size}).encode()
    body = MAGIC + struct.pack(">I", len(header)) + header + np.ascontiguousarray(pages).tobytes()
    return body + _digest(body)


def max_frame_bytes(layout: KVLayout, max_pages: int) -> int:
    return len(MAGIC) + 4 + MAX_HEADER_BYTES + max_pages * layout.page_bytes + _DIGEST_BYTES


def decode(frame: bytes, request_id: str, layout: KVLayout, max_pages: int) -> np.ndarray:
    """The pages of a frame, [layers, pages, *page]; PrefillFailed saying what is wrong."""
    def bad(why: str) -> PrefillFailed:
        return PrefillFailed(f"the prefill server's KV pages for {request_id} are unusable: {why}")

    start = len(MAGIC) + 4
    if len(frame) < start + _DIGEST_BYTES or not frame.startswith(MAGIC):
        raise bad("not a KV frame")
    (header_len,) = struct.unpack(">I", frame[len(MAGIC):start])
    if header_len > MAX_HEADER_BYTES or start + header_len + _DIGEST_BYTES > len(frame):
        raise bad(f"a header of {header_len} bytes")
    body, digest = frame[:-_DIGEST_BYTES], frame[-_DIGEST_BYTES:]
    if _digest(body) != digest:
        raise bad("the checksum does not match (corrupted in transit)")
    try:
        header = json.loads(frame[start:start + header_len])
        theirs = KVLayout(int(header["num_layers"]), int(header["page_size"]),
                          tuple(int(d) for d in header["page_shape"]), str(header["dtype"]))
        num_pages = int(header["num_pages"])
        their_id = header["request_id"]
    except (ValueError, KeyError, TypeError) as e:
        raise bad(f"an unreadable header ({type(e).__name__})") from None
    if their_id != request_id:
        raise bad(f"they are for request {str(their_id)[:100]!r}")
    if theirs != layout:
        raise bad(f"their layout {theirs} is not this server's {layout} (serve the same model, "
                  f"--kv-cache-dtype and --page-size on both sides)")
    if not 0 <= num_pages <= max_pages:
        raise bad(f"{num_pages} pages where the prompt has {max_pages} to send")
    data = body[start + header_len:]
    if len(data) != num_pages * layout.page_bytes:
        raise bad(f"{len(data)} bytes for {num_pages} pages of {layout.page_bytes}")
    pages = np.frombuffer(data, dtype=np.dtype(layout.dtype))
    return pages.reshape(layout.num_layers, num_pages, *layout.page_shape)
