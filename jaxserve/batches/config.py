"""The Batch API's bounds (serve's --batch-* flags, declared once here) and completion windows."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from jaxserve.errors import ConfigError, InvalidRequest

# What each bound is, for the flag's help (launcher builds --batch-NAME from the fields).
HELP = {
    "max_file_bytes": "largest uploaded batch input file, in bytes",
    "max_file_lines": "most requests (non-blank lines) in one batch input file",
    "max_tenant_bytes": "most bytes of files (inputs, outputs) a tenant may keep stored",
    "max_active_batches": "most unfinished batches a tenant may have at once",
    "max_concurrent_lines": "batch lines running at once over every batch (they run at the "
                            "lowest priority class; live traffic goes first)",
}


@dataclass(frozen=True)
class BatchLimits:
    max_file_bytes: int = 64 * 2**20  # OpenAI takes 200 MB: ours lives in one SQLite row
    max_file_lines: int = 50_000  # OpenAI's
    max_tenant_bytes: int = 1 * 2**30
    max_active_batches: int = 16
    max_concurrent_lines: int = 8

    def __post_init__(self):
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f"--batch-{f.name.replace('_', '-')} must be > 0, got "
                                  f"{getattr(self, f.name)}")


_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400


def window_seconds(window: str) -> int:
    """A completion_window in seconds: OpenAI's "24h", or any whole number of s, m, h or d up to
    7 days (a short one suits a test or an interactive job that must not linger)."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * _UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise InvalidRequest(f"'completion_window' must be '24h' or a whole number of s, m, h or "
                             f"d up to 7d (e.g. '90m'), got {str(window)[:40]!r}",
                             "completion_window")
    return seconds
