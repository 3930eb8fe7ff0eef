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

The file operations run on one worker thread (`DiskIO`), off the engine's: the engine thread copies
a page's bytes out of its host slot and queues the write, and queues a read ahead of the
admission that will restore it. One thread and one queue keep them in the order asked, so a read
sees the write queued before it and a deletion follows the write it undoes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np

log = logging.getLogger(__name__)

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


# Jobs queued at most: a write asked for while the queue is full waits for room, so the page
# bytes waiting to be written stay under this many pages (a read-ahead is skipped instead).
MAX_QUEUED = 64


class DiskIOStats:
    """What the worker did (written by its thread, read by the engine's stats)."""

    def __init__(self):
        self.bytes_written = 0
        self.write_errors = 0
        self.seconds = 0.0  # the worker's time on the files


class DiskIO:
    """The disk tier's file operations, in order, on a thread of their own."""

    def __init__(self, max_queued: int = MAX_QUEUED):
        self._jobs: queue.Queue = queue.Queue(max_queued)
        self.stats = DiskIOStats()
        threading.Thread(target=_work, args=(self._jobs, self.stats), name="kv-disk-io",
                         daemon=True).start()
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with its owner

    def write(self, path: str, page_hash: bytes, tokens: tuple[int, ...],
              payload: np.ndarray) -> None:
        """Queue the page's file write; `payload` must be the caller's own copy."""
        self._jobs.put((_write, (path, page_hash, tokens, payload), None))

    def unlink(self, path: str) -> None:
        self._jobs.put((_unlink, (path,), None))

    def read(self, path: str, page_hash: bytes, tokens: tuple[int, ...], nbytes: int, *,
             wait_for_room: bool = True) -> Future | None:
        """A future of read_page's answer; None when the queue is full and not `wait_for_room`."""
        future: Future = Future()
        try:
            self._jobs.put((_read, (path, page_hash, tokens, nbytes), future),
                           block=wait_for_room)
        except queue.Full:
            return None
        return future

    def flush(self) -> None:
        """Wait until every queued operation is done."""
        self._jobs.join()


def _work(jobs: queue.Queue, stats: DiskIOStats) -> None:
    while (job := jobs.get()) is not None:
        run, args, future = job
        started = time.perf_counter()
        try:
            result = run(stats, *args)
        except Exception:  # never lose the worker: a read that fails is a miss
            log.exception("the KV disk tier's worker failed on %s", args[0])
            result = None
        stats.seconds += time.perf_counter() - started
        if future is not None:
            future.set_result(result)
        jobs.task_done()


def _write(stats: DiskIOStats, path, page_hash, tokens, payload) -> None:
    try:
        stats.bytes_written += write_page(path, page_hash, tokens, payload)
    except OSError as e:  # a full or failing disk: the page is a miss when asked for
        stats.write_errors += 1
        log.warning("the KV disk tier could not write %s: %s", path, e)


def _read(stats: DiskIOStats, path, page_hash, tokens, nbytes) -> bytes | None:
    return read_page(path, page_hash, tokens, nbytes)


def _unlink(stats: DiskIOStats, path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
