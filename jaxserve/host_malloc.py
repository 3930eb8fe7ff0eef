"""glibc malloc settings for an engine on the CPU.

XLA:CPU takes each run of a program's temporaries from malloc: for the sampler, several
[rows, vocabulary] f32 arrays (tens of MB at 64 rows of a 49k vocabulary). glibc serves a request
that large with a fresh mmap and unmaps it on free (above its dynamic threshold, which stops
growing at 32 MiB), so every step faulted those pages in again, zeroed by the kernel: 64 sampled
rows took 7.1 ms per sampler call, 2.4 ms with the settings here (2-core AVX-512 host,
`benchmarks/RESULTS.md`). Serving them from the heap, and keeping what is freed instead of
trimming it, lets each step reuse the last one's pages. The cost is memory: up to
MALLOC_THRESHOLD_BYTES freed at the heap's top stays with the process.

A process whose environment already sets glibc's malloc knobs (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, or glibc.malloc tunables in GLIBC_TUNABLES) keeps its own settings.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Above any step's temporaries at the engine's sizes, below the KV cache and weights (which stay
# mmapped and go back to the system when freed).
MALLOC_THRESHOLD_BYTES = 1 << 30
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Serve allocations below MALLOC_THRESHOLD_BYTES from the heap and keep up to that much
    freed there; True if set now. False, changing nothing, off glibc or where the environment
    has its own malloc settings."""
    if any(name in os.environ for name in _USER_SETTINGS) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = (mallopt(M_MMAP_THRESHOLD, MALLOC_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, MALLOC_THRESHOLD_BYTES) == 1)
    if not done:
        log.debug("glibc refused the malloc thresholds; its defaults stay")
    return done
