"""The copies between the device KV pool, the host tier's slots and the disk tier's files that a
step asks for (no JAX).

The prefix cache's host tier (jaxserve.core.kv_offload) decides which page goes to which slot;
the runner (jaxserve.executor.kv_offload) does the copies, in the order given, before the step's
forward, so a page saved before its reuse is read before the forward overwrites it, and a page
restored is in place before the forward reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from jaxserve.errors import ConfigError

if TYPE_CHECKING:
    from jaxserve.executor.kv_files import DiskIO

GIB = 1 << 30


def tier_pages(flag: str, size_gib: float, page_bytes: int, available_bytes: int,
               available: str) -> int:
    """The pages a KV tier of size_gib GiB holds (host slots, disk files of page_bytes each); a
    ConfigError naming the flag when it holds none or asks for more than `available` has."""
    size = int(size_gib * GIB)
    if size > available_bytes:
        raise ConfigError(f"{flag} {size_gib} GiB is more than {available} "
                          f"({available_bytes / GIB:.1f} GiB)")
    if size < page_bytes:
        raise ConfigError(f"{flag} {size_gib} GiB holds no KV page (a page is {page_bytes} "
                          f"bytes)")
    return size // page_bytes


class PageCopies(NamedTuple):
    """A run of copies in one direction: device page pages[i] <-> host slot slots[i]."""

    to_host: bool  # True: the device pages are saved into the slots; False: restored from them
    pages: tuple[int, ...]
    slots: tuple[int, ...]


class DiskWrites(NamedTuple):
    """Host slots written to the disk tier's files before the step's saves overwrite them:
    slots[i] -> paths[i], the page of page_hashes[i] and tokens[i] (jaxserve.executor.kv_files).
    The slots' bytes are copied at once and the files written by the tier's worker (`io`)."""

    slots: tuple[int, ...]
    paths: tuple[str, ...]
    page_hashes: tuple[bytes, ...]
    tokens: tuple[tuple[int, ...], ...]
    io: DiskIO

    def pages(self):
        """(slot, path, page hash, tokens) of each write."""
        return zip(self.slots, self.paths, self.page_hashes, self.tokens)


class DiskLoads(NamedTuple):
    """Pages read back from the disk tier (checked): data[i], laid out as a host slot, into device
    page pages[i]."""

    pages: tuple[int, ...]
    data: tuple[bytes, ...]
