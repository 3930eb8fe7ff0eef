"""The host tier's page copies on the device side (vLLM's `--kv-offloading-size`).

A host buffer of slots, each one KV page of every layer, stored layer-major ([layers, slots,
*page row], so a copy's rows are one fancy index of it, in the pool's order), and two programs per
page-count bucket: `save_pages` gathers pages of the pool (layer l's page p is row
l * num_pages + p) and `load_pages` scatters slots back into the donated pool. Which page goes to
which slot is the host tier's (jaxserve.core.kv_offload); this module runs the copies
(PageCopies), in the order given.

A save is only enqueued: the gathered pages come to the host asynchronously (copy_to_host_async)
and are written into their slots at the next step's copies, so the copy overlaps the step's
forward. A load of a slot with a save still on its way waits for it first; a load reads
the buffer at once, so a later save into the same slot cannot change what it loaded. Counts are
padded to power-of-two buckets (the null page fills the rest: its contents are never read, and a
load pads with copies of its first slot), so the programs are compiled at warmup like every
other.

The disk tier's copies ride along (jaxserve.core.kv_disk decides them): `DiskWrites` copy slots
out and queue them for their files (jaxserve.executor.kv_files, written on the tier's worker
thread) before this step's saves can land in those slots, and `DiskLoads` scatter pages read back
from files into the pool with the same load program.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import numpy as np

from jaxserve.executor.batch_plan import NULL_PAGE, next_power_of_two
from jaxserve.executor.page_copies import DiskLoads, DiskWrites, PageCopies, tier_pages

# The largest copy one program runs; a longer run is cut into copies of this many pages.
MAX_COPY_BUCKET = 256


def _gather(kv_cache: jax.Array, rows: jax.Array) -> jax.Array:
    return kv_cache[rows]


def _scatter(kv_cache: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    return kv_cache.at[rows].set(values)


def num_host_slots(size_gib: float, page_bytes: int, available_bytes: int) -> int:
    """Slots of a host pool of size_gib GiB (tier_pages' ConfigErrors)."""
    return tier_pages("--kv-offloading-size", size_gib, page_bytes, available_bytes,
                      "the host's available memory")


class HostKVPool:
    """The slots in host memory and the copies between them and the device pool."""

    PROGRAMS = ("save_pages", "load_pages")

    def __init__(self, num_slots: int, cache_shape: tuple[int, ...], dtype, num_pages: int,
                 max_pages: int, *, kv_sharding=None, replicated=None):
        """cache_shape: the pool's array ([layers * num_pages, *page row]); max_pages: the most
        pages one program copies (rounded up to a power of two, at most MAX_COPY_BUCKET)."""
        self.num_pages = num_pages
        self.num_layers = cache_shape[0] // num_pages
        self.num_slots = num_slots
        self.buffer = np.empty((self.num_layers, num_slots, *cache_shape[1:]), dtype)
        top = min(next_power_of_two(max_pages), MAX_COPY_BUCKET)
        self.buckets = tuple(1 << i for i in range(top.bit_length()))
        self._replicated = replicated
        shardings = {} if kv_sharding is None else dict(
            save=dict(in_shardings=(kv_sharding, replicated), out_shardings=replicated),
            load=dict(in_shardings=(kv_sharding, replicated, replicated),
                      out_shardings=kv_sharding))
        self._save_jit = jax.jit(_gather, **shardings.get("save", {}))
        self._load_jit = jax.jit(_scatter, donate_argnums=0, **shardings.get("load", {}))
        self._pending: list[tuple[np.ndarray, jax.Array]] = []  # (slots, pages on their way)
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.copy_seconds = 0.0  # host time spent enqueuing and landing copies
        self.bytes_from_disk = 0  # pages read from the disk tier, copied into the pool
        # This thread's time queueing the disk tier's writes (the slots copied) and loading its
        # pages; the files are written and read on the tier's worker (kv_files.DiskIO).
        self.disk_seconds = 0.0

    @property
    def page_bytes(self) -> int:
        return self.buffer[:, 0].nbytes

    def program_keys(self) -> list[tuple]:
        return [(name, n) for name in self.PROGRAMS for n in self.buckets]

    def lower(self, key: tuple, kv_cache: jax.Array):
        name, n = key
        rows = jax.ShapeDtypeStruct((self.num_layers * n,), np.int32, sharding=self._replicated)
        if name == "save_pages":
            return self._save_jit.lower(kv_cache, rows)
        values = jax.ShapeDtypeStruct((self.num_layers * n, *kv_cache.shape[1:]),
                                      kv_cache.dtype, sharding=self._replicated)
        return self._load_jit.lower(kv_cache, rows, values)

    def run(self, copies: Sequence[PageCopies], kv_cache: jax.Array,
            program: Callable[[tuple], Callable]) -> jax.Array:
        """Run the copies in order; the pool after them (a load donates it)."""
        started = time.perf_counter()
        self.land()  # the last step's saves: done by now, so this does not wait
        disk = 0.0
        for run in copies:
            if isinstance(run, (DiskWrites, DiskLoads)):
                began = time.perf_counter()
                if isinstance(run, DiskWrites):
                    self._write_files(run)
                else:
                    kv_cache = self._load_disk(run, kv_cache, program)
                disk += time.perf_counter() - began
                continue
            pages, slots = np.asarray(run.pages, np.int32), np.asarray(run.slots, np.int64)
            for start in range(0, len(pages), self.buckets[-1]):
                chunk = slice(start, start + self.buckets[-1])
                if run.to_host:
                    self._save(pages[chunk], slots[chunk], kv_cache, program)
                else:
                    kv_cache = self._load(pages[chunk], slots[chunk], kv_cache, program)
        self.copy_seconds += time.perf_counter() - started - disk
        self.disk_seconds += disk
        return kv_cache

    def _write_files(self, run: DiskWrites) -> None:
        """Queue the slots' pages for their files, copied now (the slots hold landed pages:
        run() landed the last step's saves, and this step's, which overwrite them, come after)."""
        for slot, path, page_hash, tokens in run.pages():
            run.io.write(path, page_hash, tokens, self.buffer[:, slot].copy())

    def _load_disk(self, run: DiskLoads, kv_cache, program) -> jax.Array:
        row = self.buffer.shape[2:]
        values = np.stack([np.frombuffer(d, self.buffer.dtype).reshape(self.num_layers, *row)
                           for d in run.data], axis=1)
        pages = np.asarray(run.pages, np.int32)
        for start in range(0, len(pages), self.buckets[-1]):
            chunk = slice(start, start + self.buckets[-1])
            kv_cache = self._scatter_values(pages[chunk], values[:, chunk], kv_cache, program)
        self.bytes_from_disk += values.nbytes
        return kv_cache

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _rows(self, pages: np.ndarray) -> tuple[int, np.ndarray]:
        """The bucket and the pool rows of the pages, padded with the null page, layer-major."""
        n = self._bucket(len(pages))
        padded = np.full(n, NULL_PAGE, np.int32)
        padded[:len(pages)] = pages
        rows = np.arange(self.num_layers, dtype=np.int32)[:, None] * self.num_pages + padded
        return n, rows.reshape(-1)

    def _save(self, pages, slots, kv_cache, program) -> None:
        n, rows = self._rows(pages)
        out = program(("save_pages", n))(kv_cache, self._put(rows))
        out.copy_to_host_async()
        self._pending.append((slots, out))
        self.bytes_to_host += len(pages) * self.page_bytes

    def _load(self, pages, slots, kv_cache, program) -> jax.Array:
        if any(np.isin(slots, s).any() for s, _ in self._pending):
            self.land()
        self.bytes_to_device += len(pages) * self.page_bytes
        return self._scatter_values(pages, self.buffer[:, slots], kv_cache, program)

    def _scatter_values(self, pages, values, kv_cache, program) -> jax.Array:
        """Pages' rows ([layers, len(pages), *page row]) into the pool; the padding repeats the
        first page's rows into the null page."""
        n, rows = self._rows(pages)
        padded = np.concatenate([values, np.repeat(values[:, :1], n - len(pages), axis=1)], 1)
        flat = padded.reshape(self.num_layers * n, *self.buffer.shape[2:])
        return program(("load_pages", n))(kv_cache, self._put(rows), self._put(flat))

    def read_pages(self, pages: Sequence[int], kv_cache: jax.Array,
                   program: Callable[[tuple], Callable]) -> np.ndarray:
        """The pages' rows of every layer, [layers, len(pages), *page row], on the host now (a
        prefill server hands them to a decode server: jaxserve.disagg)."""
        pages = np.asarray(pages, np.int32)
        out = []
        for start in range(0, len(pages), self.buckets[-1]):
            chunk = pages[start:start + self.buckets[-1]]
            n, rows = self._rows(chunk)
            got = np.asarray(program(("save_pages", n))(kv_cache, self._put(rows)))
            out.append(got.reshape(self.num_layers, n, *self.buffer.shape[2:])[:, :len(chunk)])
        return np.concatenate(out, axis=1) if out else self.buffer[:, :0].copy()

    def write_slot(self, slot: int, page: np.ndarray) -> None:
        """Fill a slot with a page received from elsewhere ([layers, *page row]); saves on their
        way land first, so none of them overwrites it later."""
        self.land()
        self.buffer[:, slot] = page

    def land(self) -> None:
        """Write the saves still on their way into their slots, in the order they were made (a
        slot saved twice keeps the later page)."""
        for slots, out in self._pending:
            pages = np.asarray(out).reshape(self.num_layers, -1, *self.buffer.shape[2:])
            last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
            self.buffer[:, slots[last]] = pages[:, last]
        self._pending.clear()

    def _put(self, x):
        return jax.device_put(x, self._replicated)
