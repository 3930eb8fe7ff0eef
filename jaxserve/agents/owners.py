"""Which live server runs a background run: each server holds a lock file while it lives
(`runs/<token>.lock` under the data directory, flock'ed) and stamps its token on the runs it
starts. A run whose owner's lock is free was left by a server that is gone (killed, crashed,
stopped): the next server that looks takes it over (`ResponseStore.claim`, one winner) and
resumes it. Servers sharing a data directory so never run the same run twice. Host side: no
JAX."""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path


class RunOwner:
    def __init__(self, data_dir: Path):
        self.directory = Path(data_dir).expanduser() / "runs"
        self.token = secrets.token_hex(8)
        self._fd: int | None = None

    def _path(self, token: str) -> Path:
        return self.directory / f"{token}.lock"

    def hold(self) -> str:
        """This server's token, its lock taken (once)."""
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path(self.token), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh random name: free
            self._fd = fd
        return self.token

    def gone(self, token: str | None) -> bool:
        """Whether the server `token` no longer lives (its lock is free, or never was)."""
        if token == self.token:
            return False
        if token is None or not token.isalnum():
            return True
        try:
            fd = os.open(self._path(token), os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def forget(self, token: str) -> None:
        """A gone server's lock file, once its runs are taken over."""
        if token.isalnum() and token != self.token:
            self._path(token).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._path(self.token).unlink(missing_ok=True)
            self._fd = None
