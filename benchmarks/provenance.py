"""What a benchmark result records about where it ran: the commit and the machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """HEAD, marked dirty when the working tree differs (the numbers are of the tree as run)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if dirty else "")


def cpu() -> dict:
    """lscpu's model name and CPU count, and the SIMD flags that matter to XLA's CPU code."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    info = {}
    for line in out.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("Model name", "CPU(s)"):
            info[key] = value
        elif key == "Flags":
            info["simd flags"] = " ".join(f for f in value.split()
                                          if re.match(r"(avx|fma|sse4|amx)", f))
    return info
