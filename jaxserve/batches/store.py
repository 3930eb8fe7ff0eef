"""The Batch API's files, batches and line results in one SQLite file (WAL) under the data
directory: `batches.sqlite`.

Durability is per transaction: a line's result and the batch's counts are one commit (`record`),
so after a SIGKILL a line is either recorded and counted or neither, and a restart runs exactly
the lines with no result. The output and error files and the batch's terminal status are one
commit too (`finalize`). Every read names the tenant: another tenant's file or batch is
NotFound, as if it did not exist.

One connection, used from one thread at a time (the service runs every call on its own
single-thread executor; the lock makes any other caller safe too)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from jaxserve.errors import Conflict, NotFound, QuotaExceeded
from jaxserve.sqlite_store import SqliteStore

FILE_NAME = "batches.sqlite"
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT,
    status TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    obj TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    result TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def _file_object(row) -> dict:
    file_id, purpose, filename, size, created_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def usage_object(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def _jsonl(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


class BatchStore(SqliteStore):
    def __init__(self, data_dir: Path, clock: Callable[[], float] = time.time):
        self.clock = clock
        # A commit survives the process being killed (the WAL is written before it returns);
        # FULL also survives the machine losing power.
        super().__init__(Path(data_dir) / FILE_NAME, _SCHEMA, "batch store",
                         synchronous="FULL")

    def _now(self) -> int:
        return int(self.clock())

    # ---------------------------------------------------------------- files

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes,
                 max_tenant_bytes: int | None = None) -> dict:
        """Store a file of `tenant`'s; QuotaExceeded (429) if it would hold more than
        `max_tenant_bytes` of files (None: no bound, for the outputs a finished batch writes)."""
        def add(db):
            if max_tenant_bytes is not None:
                held = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?",
                                  (tenant,)).fetchone()[0]
                if held + len(content) > max_tenant_bytes:
                    raise QuotaExceeded(
                        f"this file would bring your stored files to {held + len(content)} "
                        f"bytes, over the server's limit of {max_tenant_bytes}; delete files "
                        f"you no longer need", "file")
            return self._insert_file(db, tenant, purpose, filename, content)
        return self._tx(add)

    def _insert_file(self, db, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        row = (new_id("file-"), purpose, filename, len(content), self._now())
        db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, tenant, content)"
                   " VALUES (?, ?, ?, ?, ?, ?, ?)", (*row, tenant, content))
        return _file_object(row)

    def file(self, tenant: str, file_id: str) -> dict:
        row = self._one("SELECT id, purpose, filename, bytes, created_at FROM files "
                        "WHERE id = ? AND tenant = ?", (file_id, tenant))
        if row is None:
            raise NotFound(f"No such File object: {file_id[:80]}", "file_id")
        return _file_object(row)

    def file_content(self, tenant: str, file_id: str) -> bytes:
        row = self._one("SELECT content FROM files WHERE id = ? AND tenant = ?",
                        (file_id, tenant))
        if row is None:
            raise NotFound(f"No such File object: {file_id[:80]}", "file_id")
        return bytes(row[0])

    def files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
              order: str) -> tuple[list[dict], bool]:
        """A page of the tenant's files by creation (`order` "asc" or "desc"), after the file
        `after` (NotFound if it is not one of the tenant's); (files, has_more)."""
        sql = ("SELECT id, purpose, filename, bytes, created_at FROM files WHERE tenant = ?"
               + (" AND purpose = ?" if purpose is not None else ""))
        args: list[Any] = [tenant] + ([purpose] if purpose is not None else [])
        if after is not None:
            sql += f" AND seq {'>' if order == 'asc' else '<'} ?"
            args.append(self._seq("files", tenant, after, "after"))
        sql += f" ORDER BY seq {'ASC' if order == 'asc' else 'DESC'} LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit + 1)).fetchall()
        return [_file_object(r) for r in rows[:limit]], len(rows) > limit

    def _seq(self, table: str, tenant: str, object_id: str, param: str) -> int:
        row = self._one(f"SELECT seq FROM {table} WHERE id = ? AND tenant = ?",
                        (object_id, tenant))
        if row is None:
            raise NotFound(f"'{param}' names no object of yours: {object_id[:80]}", param)
        return row[0]

    def delete_file(self, tenant: str, file_id: str) -> dict:
        def delete(db):
            if db.execute("SELECT 1 FROM files WHERE id = ? AND tenant = ?",
                          (file_id, tenant)).fetchone() is None:
                raise NotFound(f"No such File object: {file_id[:80]}", "file_id")
            reader = db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN "
                f"({', '.join('?' * len(UNFINISHED))})", (file_id, *UNFINISHED)).fetchone()
            if reader is not None:
                raise Conflict(f"file {file_id} is the input of batch {reader[0]}, which has "
                               f"not finished: cancel it or wait for it first", "file_id")
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return {"id": file_id, "object": "file", "deleted": True}
        return self._tx(delete)

    # ---------------------------------------------------------------- batches

    def add_batch(self, tenant: str, key_id: str | None, obj: dict,
                  max_active: int) -> dict:
        """Store a new batch (its input file must be the tenant's: NotFound naming
        input_file_id); QuotaExceeded (429) while the tenant has `max_active` unfinished."""
        def add(db):
            if db.execute("SELECT 1 FROM files WHERE id = ? AND tenant = ?",
                          (obj["input_file_id"], tenant)).fetchone() is None:
                raise NotFound(f"No such File object: {obj['input_file_id'][:80]}",
                               "input_file_id")
            active = db.execute(
                f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN "
                f"({', '.join('?' * len(UNFINISHED))})", (tenant, *UNFINISHED)).fetchone()[0]
            if active >= max_active:
                raise QuotaExceeded(f"you have {active} unfinished batches, the server's limit; "
                                    f"wait for one to finish or cancel one")
            db.execute("INSERT INTO batches (id, tenant, key_id, status, input_file_id, obj) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (obj["id"], tenant, key_id, obj["status"],
                                                     obj["input_file_id"], json.dumps(obj)))
            return obj
        return self._tx(add)

    def batch(self, tenant: str | None, batch_id: str) -> dict:
        """A batch of `tenant`'s (None: anyone's, for the runner)."""
        row = self._one("SELECT obj, tenant FROM batches WHERE id = ?", (batch_id,))
        if row is None or (tenant is not None and row[1] != tenant):
            raise NotFound(f"No such Batch object: {batch_id[:80]}", "batch_id")
        return json.loads(row[0])

    def owner(self, batch_id: str) -> tuple[str, str | None]:
        """(tenant, key id) a batch runs as."""
        return self._one("SELECT tenant, key_id FROM batches WHERE id = ?", (batch_id,))

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of the tenant's batches, newest first; (batches, has_more)."""
        sql, args = "SELECT obj FROM batches WHERE tenant = ?", [tenant]
        if after is not None:
            sql += " AND seq < ?"
            args.append(self._seq("batches", tenant, after, "after"))
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        return [json.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE status IN ({', '.join('?' * len(UNFINISHED))}) "
                f"ORDER BY seq", UNFINISHED).fetchall()
        return [r[0] for r in rows]

    def update(self, batch_id: str, changes: dict, *, only_from: tuple[str, ...] = UNFINISHED,
               tenant: str | None = None) -> dict:
        """Apply `changes` to a batch whose status is in `only_from` (Conflict otherwise); a
        change of status stamps `<status>_at`."""
        def apply(db):
            obj = self._locked_batch(db, tenant, batch_id)
            if obj["status"] not in only_from:
                raise Conflict(f"batch {batch_id} is {obj['status']}", "batch_id")
            self._put(db, obj, changes)
            return obj
        return self._tx(apply)

    def _locked_batch(self, db, tenant: str | None, batch_id: str) -> dict:
        row = db.execute("SELECT obj, tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (tenant is not None and row[1] != tenant):
            raise NotFound(f"No such Batch object: {batch_id[:80]}", "batch_id")
        return json.loads(row[0])

    def _put(self, db, obj: dict, changes: dict) -> None:
        obj.update(changes)
        if "status" in changes and changes["status"] != "validating":
            obj[f"{changes['status']}_at"] = self._now()
        db.execute("UPDATE batches SET obj = ?, status = ? WHERE id = ?",
                   (json.dumps(obj), obj["status"], obj["id"]))

    # ---------------------------------------------------------------- line results

    def record(self, batch_id: str, line: int, ok: bool, result: dict,
               usage: tuple[int, int, int, int]) -> None:
        """A line's result line, its count and its `usage` (input, output, cached, reasoning
        tokens), in one commit. A line recorded already is left as it is (its first result
        stands)."""
        def add(db):
            cur = db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                             (batch_id, line, int(ok), json.dumps(result, ensure_ascii=False)))
            if cur.rowcount == 0:
                return
            obj = self._locked_batch(db, None, batch_id)
            counts = dict(obj["request_counts"])
            counts["completed" if ok else "failed"] += 1
            u = obj["usage"] or usage_object(0, 0, 0, 0)
            used = usage_object(u["input_tokens"] + usage[0], u["output_tokens"] + usage[1],
                                u["input_tokens_details"]["cached_tokens"] + usage[2],
                                u["output_tokens_details"]["reasoning_tokens"] + usage[3])
            self._put(db, obj, {"request_counts": counts, "usage": used})
        self._tx(add)

    def done_lines(self, batch_id: str) -> set[int]:
        with self._lock:
            rows = self._db.execute("SELECT line FROM results WHERE batch_id = ?",
                                    (batch_id,)).fetchall()
        return {r[0] for r in rows}

    def finalize(self, batch_id: str, status: str, unrun: list[dict]) -> dict:
        """End a batch as `status` (completed, expired or cancelled) in one commit: its output
        file (the 200s, by line), its error file (the other results, then `unrun`: a line that
        never ran, as its error line), its counts. A file with no line is not written (its id
        stays null), as OpenAI does."""
        def end(db):
            obj = self._locked_batch(db, None, batch_id)
            if obj["status"] not in UNFINISHED:
                return obj  # finalized already (a restart between commit and reply)
            tenant = self.owner_locked(db, batch_id)
            rows = db.execute("SELECT ok, result FROM results WHERE batch_id = ? ORDER BY line",
                              (batch_id,)).fetchall()
            output = [r[1] for r in rows if r[0]]
            errors = [r[1] for r in rows if not r[0]]
            errors += [json.dumps(u, ensure_ascii=False) for u in unrun]
            changes: dict[str, Any] = {"status": status}
            for key, lines, name in (("output_file_id", output, "output"),
                                     ("error_file_id", errors, "error")):
                if lines:
                    changes[key] = self._insert_file(db, tenant, "batch_output",
                                                     f"{batch_id}_{name}.jsonl",
                                                     _jsonl(lines))["id"]
            counts = dict(obj["request_counts"])
            counts["failed"] += len(unrun)
            changes["request_counts"] = counts
            self._put(db, obj, changes)
            return obj
        return self._tx(end)

    @staticmethod
    def owner_locked(db, batch_id: str) -> str:
        return db.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
