"""The copies between the device KV pool, the host tier's slots and the disk tier's files that a
step asks for (no JAX).

The prefix cache's host tier (jaxserve.core.kv_offload) decides which page goes to which slot;
the runner (jaxserve.executor.kv_offload) does the copies, in the order given, before the step's
forward, so a page saved before its reuse is read before the forward overwrites it, and a page
restored is in place before the forward reads it.
"""

from __future__ import annotations

from typing import NamedTuple


class PageCopies(NamedTuple):
    """A run of copies in one direction: device page pages[i] <-> host slot slots[i]."""

    to_host: bool  # True: the device pages are saved into the slots; False: restored from them
    pages: tuple[int, ...]
    slots: tuple[int, ...]


class DiskWrites(NamedTuple):
    """Host slots written to the disk tier's files before the step's saves overwrite them:
    slots[i] -> paths[i], the page of page_hashes[i] and tokens[i] (jaxserve.executor.kv_files)."""

    slots: tuple[int, ...]
    paths: tuple[str, ...]
    page_hashes: tuple[bytes, ...]
    tokens: tuple[tuple[int, ...], ...]


class DiskLoads(NamedTuple):
    """Pages read back from the disk tier (checked): data[i], laid out as a host slot, into device
    page pages[i]."""

    pages: tuple[int, ...]
    data: tuple[bytes, ...]
