"""Stored responses, the events of their recorded streams and their runs' step logs: one SQLite
file in WAL mode under the data directory (`responses.sqlite3`). Host side: no JAX.

A response belongs to its tenant: every read names the tenant, and another tenant's response
does not exist (the routes answer 404). It lives `ttl_s` after its creation (--response-ttl),
then is invisible and purged. Deleting it removes its row, its events and its steps, with
`secure_delete` on and the WAL checkpointed, so its content leaves the file. The store's
content is bounded (`max_bytes`: a new stored response past it is a 429 insufficient_quota),
and so is a chain's length (`MAX_CHAIN`).

Durability: WAL with synchronous=NORMAL, so a committed write survives the process being killed
(SIGKILL); an operating-system crash may lose the last commits. The step log is written ahead:
a step is committed `started` before it runs and `completed` (or `failed`) after.

One connection, used under a lock by the event loop (each statement is short; the WAL lets the
checkpoint and readers of other processes, such as `sqlite3` itself, run beside it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jaxserve.errors import ConfigError, InvalidRequest, QuotaExceeded
from jaxserve.sqlite_store import SqliteStore

FILE_NAME = "responses.sqlite3"
DEFAULT_TTL_S = 7 * 24 * 3600.0  # a week: shorter than OpenAI's 30 days (less kept by default)
DEFAULT_MAX_BYTES = 1 << 30
MAX_CHAIN = 256  # responses in one previous_response_id chain
UNFINISHED = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, status TEXT NOT NULL, background INTEGER NOT NULL,
    previous_id TEXT, settings TEXT NOT NULL, input_items TEXT NOT NULL, response TEXT NOT NULL,
    deadline_at REAL, nbytes INTEGER NOT NULL, owner TEXT);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses(expires_at);
CREATE INDEX IF NOT EXISTS responses_status ON responses(status);
CREATE TABLE IF NOT EXISTS events (
    response_id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL,
    PRIMARY KEY (response_id, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS steps (
    step_id TEXT PRIMARY KEY, response_id TEXT NOT NULL, position INTEGER NOT NULL,
    kind TEXT NOT NULL, tool TEXT, input TEXT NOT NULL, status TEXT NOT NULL, output TEXT,
    started_at REAL NOT NULL, ended_at REAL, attempts INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS steps_response ON steps(response_id, position);
"""


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path
    ttl_s: float = DEFAULT_TTL_S
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self):
        if not self.ttl_s > 0:
            raise ConfigError(f"--response-ttl must be > 0 seconds, got {self.ttl_s}")
        if self.max_bytes < 1 << 20:
            raise ConfigError(f"the response store's max_bytes must be >= 1 MiB, got "
                              f"{self.max_bytes}")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant: str
    status: str
    background: bool
    previous_id: str | None
    settings: dict  # the request as validated (JSON): what a resumed run runs again
    input_items: list[dict]
    response: dict  # the response object as last saved
    deadline_at: float | None  # unix time the run must end by


@dataclass(frozen=True)
class Step:
    step_id: str
    position: int
    kind: str  # "model_turn" | "tool_call"
    tool: str | None
    input: Any
    status: str  # "started" -> "completed" | "failed" (a tool error) | "error" | "cancelled"
    output: Any
    started_at: float
    ended_at: float | None
    attempts: int


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class ResponseStore(SqliteStore):
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        super().__init__(Path(config.data_dir) / FILE_NAME, _SCHEMA, "response store",
                         secure_delete=True)
        self.purge_expired()

    def _migrate(self, db) -> None:
        columns = {r[1] for r in db.execute("PRAGMA table_info(responses)")}
        if "owner" not in columns:  # a file from before runs had owners
            db.execute("ALTER TABLE responses ADD COLUMN owner TEXT")

    # ---------------------------------------------------------------- responses

    def create(self, tenant: str, response: dict, settings: dict, input_items: list[dict],
               background: bool, deadline_at: float | None, owner: str | None = None) -> None:
        """`owner`: the token of the server running it in the background (agents/owners.py)."""
        body = _dumps(response), _dumps(settings), _dumps(input_items)
        nbytes = sum(len(b) for b in body)
        now = self.clock()

        def insert(db):
            used = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM responses").fetchone()[0]
            if used + nbytes > self.config.max_bytes:
                raise QuotaExceeded("the response store is full: delete stored responses, or "
                                    "send store false")
            db.execute("INSERT INTO responses VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                       (response["id"], tenant, now, now + self.config.ttl_s,
                        response["status"], int(background), response["previous_response_id"],
                        body[1], body[2], body[0], deadline_at, nbytes, owner))
        self._tx(insert)
        self.purge_expired()

    def save(self, response: dict) -> None:
        """The response object as it now stands (its status with it)."""
        data = _dumps(response)
        with self._lock:
            self._db.execute("UPDATE responses SET response=?, status=?, "
                             "nbytes=length(settings)+length(input_items)+? WHERE id=?",
                             (data, response["status"], len(data), response["id"]))

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The response, if it exists, is the tenant's (None: any tenant's, for a resumed run)
        and has not expired."""
        row = self._one("SELECT id, tenant, status, background, previous_id, settings, "
                        "input_items, response, deadline_at FROM responses WHERE id=? AND "
                        "expires_at>? AND (? IS NULL OR tenant=?)",
                        (response_id, self.clock(), tenant, tenant))
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], bool(row[3]), row[4], json.loads(row[5]),
                              json.loads(row[6]), json.loads(row[7]), row[8])

    def chain(self, tenant: str, response_id: str) -> list[StoredResponse]:
        """The responses of a previous_response_id chain, oldest first, ending with
        `response_id`; InvalidRequest when one of them is missing (deleted, expired, another
        tenant's: all the same) or the chain is longer than MAX_CHAIN."""
        out: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None:
            if len(out) == MAX_CHAIN:
                raise InvalidRequest(f"the previous_response_id chain is longer than "
                                     f"{MAX_CHAIN} responses: start a new conversation",
                                     param="previous_response_id")
            stored = self.get(tenant, current)
            if stored is None:
                raise InvalidRequest(f"Previous response with id '{current}' not found.",
                                     param="previous_response_id")
            out.append(stored)
            current = stored.previous_id
        return out[::-1]

    def delete(self, tenant: str, response_id: str) -> bool:
        def remove(db):
            n = db.execute("DELETE FROM responses WHERE id=? AND tenant=?",
                           (response_id, tenant)).rowcount
            if n:
                db.execute("DELETE FROM events WHERE response_id=?", (response_id,))
                db.execute("DELETE FROM steps WHERE response_id=?", (response_id,))
            return bool(n)
        deleted = self._tx(remove)
        if deleted:  # its pages, zeroed, leave the WAL too
            with self._lock:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return deleted

    def status(self, response_id: str) -> str | None:
        row = self._one("SELECT status FROM responses WHERE id=?", (response_id,))
        return None if row is None else row[0]

    def unfinished(self) -> list[tuple[str, str | None]]:
        """(id, owner) of the background responses a run was working on (queued or in
        progress): those whose owner is gone are resumed by a server that claims them."""
        with self._lock:
            return self._db.execute(
                "SELECT id, owner FROM responses WHERE background=1 AND status IN (?,?) AND "
                "expires_at>? ORDER BY created_at", (*UNFINISHED, self.clock())).fetchall()

    def claim(self, response_id: str, owner: str | None, new_owner: str) -> bool:
        """Take the run over from `owner` (gone); False when another server took it first."""
        with self._lock:
            return self._db.execute(
                "UPDATE responses SET owner=? WHERE id=? AND owner IS ?",
                (new_owner, response_id, owner)).rowcount == 1

    def purge_expired(self) -> int:
        now = self.clock()

        def purge(db):
            ids = [r[0] for r in db.execute("SELECT id FROM responses WHERE expires_at<=? "
                                            "LIMIT 1000", (now,))]
            for table, column in (("responses", "id"), ("events", "response_id"),
                                  ("steps", "response_id")):
                db.executemany(f"DELETE FROM {table} WHERE {column}=?", [(i,) for i in ids])
            return len(ids)
        return self._tx(purge)

    # ---------------------------------------------------------------- recorded stream events

    def add_event(self, response_id: str, event: dict) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO events VALUES (?,?,?)",
                             (response_id, event["sequence_number"], _dumps(event)))

    def events_after(self, response_id: str, after: int, limit: int = 256) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT event FROM events WHERE response_id=? AND seq>? "
                                    "ORDER BY seq LIMIT ?", (response_id, after, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def last_event(self, response_id: str) -> int:
        """The sequence number of the last recorded event; -1 when none."""
        row = self._one("SELECT MAX(seq) FROM events WHERE response_id=?", (response_id,))
        return -1 if row[0] is None else row[0]

    # ---------------------------------------------------------------- the step log

    def steps(self, response_id: str) -> list[Step]:
        with self._lock:
            rows = self._db.execute(
                "SELECT step_id, position, kind, tool, input, status, output, started_at, "
                "ended_at, attempts FROM steps WHERE response_id=? ORDER BY position",
                (response_id,)).fetchall()
        return [Step(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5],
                     None if r[6] is None else json.loads(r[6]), r[7], r[8], r[9]) for r in rows]

    def begin_step(self, response_id: str, step_id: str, position: int, kind: str,
                   tool: str | None, step_input: Any) -> None:
        """Written (committed) before the step runs; a step run again (it was started, never
        completed) keeps its id and counts one more attempt."""
        with self._lock:
            self._db.execute(
                "INSERT INTO steps VALUES (?,?,?,?,?,?,'started',NULL,?,NULL,1) "
                "ON CONFLICT(step_id) DO UPDATE SET status='started', attempts=attempts+1, "
                "started_at=excluded.started_at",
                (step_id, response_id, position, kind, tool, _dumps(step_input), self.clock()))

    def end_step(self, step_id: str, status: str, output: Any) -> None:
        with self._lock:
            self._db.execute("UPDATE steps SET status=?, output=?, ended_at=? WHERE step_id=?",
                             (status, _dumps(output), self.clock(), step_id))
