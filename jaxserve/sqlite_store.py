"""One SQLite file in WAL mode under the data directory, shared by a store's threads: the base of
the Batch API's store and the stored responses' (one connection, one lock, transactions that roll
back on any error). Host side; no JAX."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from jaxserve.errors import ConfigError


class SqliteStore:
    """`path`'s database with `schema` applied (`what` names it in the error when it cannot be
    opened). `synchronous`: SQLite's setting (FULL: a commit also survives losing power);
    `secure_delete`: freed pages are zeroed, so deleted content leaves the file."""

    def __init__(self, path: Path, schema: str, what: str, *, synchronous: str = "NORMAL",
                 secure_delete: bool = False):
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            if secure_delete:
                self._db.execute("PRAGMA secure_delete=ON")
            self._db.executescript(schema)
            self._migrate(self._db)
        except (OSError, sqlite3.Error) as e:
            raise ConfigError(f"cannot open the {what} in {path.parent}: {e}") from None
        self._lock = threading.Lock()

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Bring a file an older version wrote up to the schema (nothing by default)."""

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, fn):
        """`fn(connection)` in one immediate transaction, rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return out

    def _one(self, sql: str, args: tuple):
        with self._lock:
            return self._db.execute(sql, args).fetchone()
