"""The prefix cache's optional third tier, on local disk (`--kv-offloading-disk-path DIR`,
`--kv-offloading-disk-size GiB`): which page is in which file. No JAX.

A page the host tier overwrites (jaxserve.core.kv_offload, its LRU) is written to a file of its
own (jaxserve.executor.kv_files: keyed by the chained per-tenant hash, so tenant salts apply here
as in the other tiers; token ids and a checksum inside), and read back when a waiting request's
prefix needs it: the scheduler reads and checks the file (`read`) before it restores the page into
the device pool, so a corrupt, partial or vanished file is a miss, never a wrong page. Files are
a fixed number (the size over one file's), least recently used first out; which slot is written
where is the executor's (`take_writes`, run with the step's other copies).

The file operations run on the tier's worker thread (kv_files.DiskIO), in the order asked: the
executor copies a slot's bytes and queues its write, deletions are queued here, and a read waits
only for its own file. The next waiting requests' disk pages are read ahead (`read_ahead`, up to
MAX_PREFETCHED pages held) while they wait, so their admission finds them read; what `read`
returns is checked by the worker exactly as before (read_page).

The directory is this process's alone: created 0700 (an existing one must be ours, not a
symlink, and either empty or marked as a jaxserve KV tier by an earlier run), locked (a second
engine on it fails at start), and emptied of its page files at start. Pages are never reused
across runs: the hash covers the tokens and the tenant salt, not the model or its weights, so an
old file could be another model's KV.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import time
from collections import OrderedDict
from concurrent.futures import Future

from jaxserve.errors import ConfigError
from jaxserve.executor.kv_files import FORMAT_VERSION, SUFFIX, DiskIO, file_bytes, page_file
from jaxserve.executor.page_copies import DiskWrites, tier_pages

MARKER = "JAXSERVE_KV_TIER"  # names the format version; holds the lock
# Pages read ahead and not yet restored, at most: their bytes are held in memory.
MAX_PREFETCHED = 64


def disk_tier(cache_config, page_bytes: int) -> DiskTier | None:
    """The disk tier a CacheConfig asks for (None: none), its directory made ready."""
    path = cache_config.kv_offloading_disk_path
    if not path:
        return None
    lock = open_directory(path)
    files = num_disk_files(cache_config.kv_offloading_disk_size,
                           file_bytes(cache_config.page_size, page_bytes), path)
    return DiskTier(path, files, page_bytes, lock=lock)


def open_directory(path: str):
    """Make `path` this process's tier directory (see the module docstring); the locked marker
    file, open (the lock lasts while it is)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"--kv-offloading-disk-path {path}: {e.strerror}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(f"--kv-offloading-disk-path {path} must be a directory of this user "
                          f"(not a symlink)")
    names = set(os.listdir(path))
    if names and MARKER not in names:
        raise ConfigError(f"--kv-offloading-disk-path {path} is neither empty nor a jaxserve KV "
                          f"tier directory: it is emptied at start, so give an empty one")
    os.chmod(path, 0o700)
    fd = os.open(os.path.join(path, MARKER), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"--kv-offloading-disk-path {path} is in use by another engine") \
            from None
    for name in names - {MARKER}:  # an earlier run's pages and partial writes
        full = os.path.join(path, name)
        if name.endswith((SUFFIX, SUFFIX + ".tmp")) and not os.path.islink(full):
            os.unlink(full)
    os.ftruncate(fd, 0)
    os.write(fd, f"jaxserve KV tier, format {FORMAT_VERSION}\n".encode())
    return os.fdopen(fd, "r+b")


def num_disk_files(size_gib: float, file_bytes: int, path: str) -> int:
    """Files of a tier of size_gib GiB (tier_pages' ConfigErrors, against the free space)."""
    return tier_pages("--kv-offloading-disk-size", size_gib, file_bytes,
                      shutil.disk_usage(path).free, f"the free space under {path}")


class DiskTier:
    def __init__(self, directory: str, num_files: int, page_bytes: int, *, lock=None):
        self._lock = lock  # open_directory's marker file: the directory stays this engine's
        self.directory = directory
        self.num_files = num_files
        self.page_bytes = page_bytes
        self._files: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # hash -> tokens, LRU
        self._writes: dict[bytes, int] = {}  # hash -> host slot, not yet taken
        self._prefetched: dict[bytes, Future] = {}  # hash -> its read, started ahead
        self.io = DiskIO()
        self.pages_written = 0
        self.pages_read = 0
        self.read_seconds = 0.0  # the engine thread's time waiting for reads
        self.bad_files = 0  # files that did not hold their page intact (dropped)

    @property
    def num_pages(self) -> int:
        return len(self._files)

    def holds(self, page_hash: bytes, tokens: tuple[int, ...]) -> bool:
        return self._files.get(page_hash) == tokens and page_hash not in self._writes

    def spill(self, page_hash: bytes, tokens: tuple[int, ...], slot: int) -> None:
        """Keep the page host slot `slot` holds (the host tier is about to overwrite it)."""
        if page_hash in self._files:
            self._files.move_to_end(page_hash)
            return
        while len(self._files) >= self.num_files:
            self._drop(next(iter(self._files)))
        self._files[page_hash] = tokens
        self._writes[page_hash] = slot
        self.pages_written += 1

    @property
    def writes_pending(self) -> bool:
        """Whether spilled pages wait for `take_writes`."""
        return bool(self._writes)

    def read_ahead(self, pages) -> None:
        """Have these pages' files read, (hash, tokens) in order, up to MAX_PREFETCHED: the next
        waiting requests' (reads of pages no longer wanted are forgotten; new ones are skipped
        while the worker's queue is full)."""
        pages = pages[:MAX_PREFETCHED]
        wanted = {h for h, _ in pages}
        for page_hash in [h for h in self._prefetched if h not in wanted]:
            del self._prefetched[page_hash]
        for page_hash, tokens in pages:
            if page_hash in self._prefetched or not self.holds(page_hash, tokens):
                continue
            future = self.io.read(page_file(self.directory, page_hash), page_hash, tokens,
                                  self.page_bytes, wait_for_room=False)
            if future is None:
                return
            self._prefetched[page_hash] = future

    def read(self, page_hash: bytes, tokens: tuple[int, ...]) -> bytes | None:
        """The page's bytes, checked; None (and the file dropped) when it is not intact."""
        started = time.perf_counter()
        future = self._prefetched.pop(page_hash, None) or self.io.read(
            page_file(self.directory, page_hash), page_hash, tokens, self.page_bytes)
        data = future.result()
        self.read_seconds += time.perf_counter() - started
        if data is None:
            self.bad_files += 1
            self._drop(page_hash)
            return None
        self._files.move_to_end(page_hash)
        self.pages_read += 1
        return data

    def refresh(self, page_hashes) -> None:
        for page_hash in page_hashes:
            if page_hash in self._files:
                self._files.move_to_end(page_hash)

    def take_writes(self) -> DiskWrites | None:
        if not self._writes:
            return None
        hashes = tuple(self._writes)
        out = DiskWrites(tuple(self._writes.values()),
                         tuple(page_file(self.directory, h) for h in hashes), hashes,
                         tuple(self._files[h] for h in hashes), self.io)
        self._writes = {}
        return out

    def drop_unrun_writes(self) -> None:
        for page_hash in list(self._writes):
            self._drop(page_hash)

    def _drop(self, page_hash: bytes) -> None:
        del self._files[page_hash]
        self._prefetched.pop(page_hash, None)
        if self._writes.pop(page_hash, None) is None:  # a pending write has no file yet
            self.io.unlink(page_file(self.directory, page_hash))

    def check_invariants(self) -> None:
        assert len(self._files) <= self.num_files, "more files than the bound"
        assert self._writes.keys() <= self._files.keys()
        assert self._prefetched.keys() <= self._files.keys()
        assert len(self._prefetched) <= MAX_PREFETCHED
