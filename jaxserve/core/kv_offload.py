"""The prefix cache's host-memory tier (vLLM's `--kv-offloading-size`): which page goes where.

Bookkeeping only, plain Python: the copies themselves are the executor's (PageCopies, run by
jaxserve.executor.kv_offload before the step's forward). When the device pool's LRU evicts an
indexed full page (KVCacheManager._pop_page) the page is saved here: a copy goes to a host slot,
keyed by the page's chained hash (the salt and the whole prefix behind it, so tenants stay apart
in this tier as in the device one) together with its token ids, which a hit compares as the
device cache does. A page already held is not copied again. The slots are a fixed number (the
pool's bytes over one page's): when all hold a page, the least recently used one is overwritten,
so the pool never grows past its bound. The device cache evicts a prefix's tail first, so the
tail is saved first and is the first to go here too (a page is useless once its parent is gone).
A restore (KVCacheManager.restore_prefix) copies a slot back into a free device page, which the
device cache then indexes as its own; the slot keeps its copy.

Copies are taken once per step (`take_copies`): the saves, then the restores, which the runner
runs in that order before the step's forward. That order is safe because a page restored in a step
is not saved again in it (its hash is held here: a save only refreshes it) and a slot a restore
reads is not overwritten in it (a save passes over it); a device page saved and then handed to a
restore is read before it is overwritten, and a slot saved and then restored is landed first (the
runner waits for that save).

With a disk tier (jaxserve.core.kv_disk), a page whose slot the LRU overwrites is written to disk
first (those writes come first in a step's copies, before the saves that overwrite the slots; a
slot saved in this step is not overwritten again in it, so what is written is a landed page; a
slot `put` overwrites between steps has its page's write taken and run before it is filled), and
`find` reads a page the host no longer holds back from its file, checked, before the scheduler
restores it: such a page goes from the file's bytes straight into its device page (the restores
from disk come last).
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.core.kv_disk import DiskTier
from jaxserve.errors import ConfigError
from jaxserve.executor.page_copies import DiskLoads, PageCopies


class HostTier:
    def __init__(self, num_slots: int, disk: DiskTier | None = None):
        if num_slots < 1:
            raise ConfigError(f"the host KV tier needs at least one page, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # page hash -> slot, LRU first
        self._tokens: dict[bytes, tuple[int, ...]] = {}
        self._saves: list[tuple[int, int]] = []  # (device page, slot) not yet taken
        self._loads: list[tuple[int, int]] = []
        self._reading: set[int] = set()  # slots of the restores not yet taken
        self._writing: set[int] = set()  # slots of the saves not yet taken
        self.disk = disk
        self._fetched: dict[bytes, bytes] = {}  # pages read from disk by `find`, to restore
        self._disk_loads: list[tuple[int, bytes]] = []  # (device page, the page's bytes)
        self.pages_saved = 0  # device -> host copies, total since start
        self.pages_restored = 0  # host -> device copies

    @property
    def num_pages(self) -> int:
        """Pages held now (at most num_slots)."""
        return len(self._slots)

    def holds(self, page_hash: bytes, tokens: tuple[int, ...]) -> bool:
        return self._tokens.get(page_hash) == tokens

    def save(self, page_hash: bytes, tokens: tuple[int, ...], page: int) -> None:
        """Keep a copy of device page `page`, evicted from the device cache (only refreshed when
        this prefix page is held already)."""
        if page_hash in self._slots:
            self._slots.move_to_end(page_hash)
            return
        if self._free:
            slot = self._free.pop()
        else:
            # With a disk tier, a slot saved this step is not overwritten in it: its page has not
            # landed, so it could not be written to disk.
            busy = self._reading | self._writing if self.disk is not None else self._reading
            old = next((h for h, s in self._slots.items() if s not in busy), None)
            if old is None:
                return  # every slot is busy this step: the page is not kept
            slot = self._slots.pop(old)
            old_tokens = self._tokens.pop(old)
            if self.disk is not None:
                self.disk.spill(old, old_tokens, slot)
        self._slots[page_hash] = slot
        self._tokens[page_hash] = tokens
        self._saves.append((page, slot))
        self._writing.add(slot)
        self.pages_saved += 1

    def find(self, page_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether this page can be restored: held here, or its disk file read back intact."""
        if self.holds(page_hash, tokens) or page_hash in self._fetched:
            return True
        if self.disk is None or not self.disk.holds(page_hash, tokens):
            return False
        data = self.disk.read(page_hash, tokens)
        if data is not None:
            self._fetched[page_hash] = data
        return data is not None

    def put(self, page_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The slot to fill with a page computed elsewhere (a prefill server's, jaxserve.disagg),
        which the caller writes at once; None when the page is held already. Taken like a save's
        slot (a free one, else the least recently used is overwritten, spilled to the disk tier
        when there is one: the caller runs `take_copies` before writing the slot, so the file
        is written from the page the slot held)."""
        if page_hash in self._slots:
            self._slots.move_to_end(page_hash)
            return None
        assert not self._saves and not self._reading, "between steps: no copy is pending"
        assert self.disk is None or not self.disk.writes_pending, "the last spill's copies run"
        if self._free:
            slot = self._free.pop()
        else:
            old = next(iter(self._slots))
            slot = self._slots.pop(old)
            old_tokens = self._tokens.pop(old)
            if self.disk is not None:
                self.disk.spill(old, old_tokens, slot)
        self._slots[page_hash] = slot
        self._tokens[page_hash] = tokens
        return slot

    def reserve(self, page_hashes) -> None:
        """Keep the slots of these held pages from being overwritten until the copies are taken
        (they are about to be restored)."""
        self._reading.update(self._slots[h] for h in page_hashes if h in self._slots)

    def restore(self, page_hash: bytes, page: int) -> bool:
        """Copy the page of this hash into device page `page` (the caller checked `find` and
        reserved it); True when it comes from disk."""
        data = self._fetched.pop(page_hash, None)
        if data is not None:
            self._disk_loads.append((page, data))
            return True
        slot = self._slots[page_hash]
        assert slot in self._reading, "a restored slot is reserved first"
        self._loads.append((page, slot))
        self.pages_restored += 1
        return False

    def refresh(self, page_hashes) -> None:
        """Mark these held pages used now, the last one most recently (a restored prefix is
        refreshed tail first, so its head is the last to go)."""
        for page_hash in page_hashes:
            if page_hash in self._slots:
                self._slots.move_to_end(page_hash)
        if self.disk is not None:
            self.disk.refresh(page_hashes)

    def take_copies(self) -> tuple:
        """The copies recorded since the last call: the disk writes, the saves, the restores,
        then the restores from disk."""
        writes = self.disk.take_writes() if self.disk is not None else None
        out = tuple(PageCopies(to_host, *map(tuple, zip(*copies)))
                    for to_host, copies in ((True, self._saves), (False, self._loads)) if copies)
        if self._disk_loads:
            out += (DiskLoads(*map(tuple, zip(*self._disk_loads))),)
        self._saves, self._loads, self._reading, self._writing = [], [], set(), set()
        self._disk_loads, self._fetched = [], {}
        return ((writes,) if writes is not None else ()) + out

    def drop_unrun_copies(self) -> None:
        """The device pool was freed before the recorded copies ran (a sleeping engine): forget
        them, and the pages whose saves never ran (their slots would hold nothing)."""
        unsaved = {slot for _, slot in self._saves}
        for page_hash in [h for h, slot in self._slots.items() if slot in unsaved]:
            self._free.append(self._slots.pop(page_hash))
            del self._tokens[page_hash]
        self._saves, self._loads, self._reading, self._writing = [], [], set(), set()
        self._disk_loads, self._fetched = [], {}
        if self.disk is not None:
            self.disk.drop_unrun_writes()

    def check_invariants(self) -> None:
        slots = list(self._slots.values())
        assert len(slots) <= self.num_slots, "more pages than slots"
        assert len(set(slots)) == len(slots) and not set(slots) & set(self._free), \
            "a slot is held twice"
        assert len(slots) + len(self._free) == self.num_slots, "a slot leaked"
        assert self._tokens.keys() == self._slots.keys()
        if self.disk is not None:
            self.disk.check_invariants()
