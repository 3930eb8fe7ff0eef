"""jaxserve.host_malloc: glibc's malloc thresholds for an engine on the CPU."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")

# In a fresh process (the settings are process-wide): how many bytes a 64 MiB malloc put in mmapped
# chunks (mallinfo2's hblkhd), before and after keep_freed_memory.
_SCRIPT = """
import ctypes, json
from jaxserve import host_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mmapped_by_malloc(size):
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    grown = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return grown

size = 64 << 20
default = mmapped_by_malloc(size)
changed = host_malloc.keep_freed_memory()
print(json.dumps([default, changed, mmapped_by_malloc(size)]))
"""


def _run(env_extra: dict) -> list:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env={**env, **env_extra},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return __import__("json").loads(run.stdout)


def test_large_blocks_come_from_the_heap_once_set():
    default, changed, after = _run({})
    assert default >= 64 << 20  # glibc's default: a fresh mapping, unmapped on free
    assert changed
    assert after == 0


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}])
def test_the_environments_own_malloc_settings_are_kept(env):
    default, changed, after = _run(env)
    assert not changed
    assert after == default >= 64 << 20
