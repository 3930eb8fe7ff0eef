"""Conversations (OpenAI's Conversations API): a tenant's durable list of Responses items, which a
response names by `conversation` to read as its history and to which it adds its input and
output. One SQLite file in WAL mode under the data directory (`conversations.sqlite3`). Host
side: no JAX.

A conversation belongs to its tenant: another tenant's does not exist (the routes answer 404).
Conversations do not expire (as OpenAI's); deleting one removes its row and its items with
`secure_delete` on and the WAL checkpointed, so its content leaves the file. Bounds: the store's
bytes (`max_bytes`: past it a new item is a 429 insufficient_quota) and the items of one
conversation (`MAX_ITEMS`: past it, a 400 naming the field that adds them).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jaxserve.errors import InvalidRequest, NotFound, QuotaExceeded
from jaxserve.sqlite_store import SqliteStore

FILE_NAME = "conversations.sqlite3"
DEFAULT_MAX_BYTES = 1 << 30
MAX_ITEMS = 2048  # items of one conversation (each one a response's history reads)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at INTEGER NOT NULL,
    metadata TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    conversation_id TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, item TEXT NOT NULL,
    nbytes INTEGER NOT NULL, PRIMARY KEY (conversation_id, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS items_id ON items(conversation_id, id);
"""


@dataclass(frozen=True)
class Page:
    items: list[dict]
    has_more: bool


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


class ConversationStore(SqliteStore):
    def __init__(self, data_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.time):
        self.max_bytes = max_bytes
        self.clock = clock
        super().__init__(Path(data_dir) / FILE_NAME, _SCHEMA, "conversation store",
                         secure_delete=True)

    def create(self, tenant: str, metadata: dict, items: list[dict]) -> dict:
        conversation = {"id": f"conv_{secrets.token_hex(24)}", "object": "conversation",
                        "created_at": int(self.clock()), "metadata": metadata}

        def insert(db):
            db.execute("INSERT INTO conversations VALUES (?,?,?,?)",
                       (conversation["id"], tenant, conversation["created_at"],
                        _dumps(metadata)))
            self._append(db, conversation["id"], items, "items")
        self._tx(insert)
        return conversation

    def get(self, tenant: str, conversation_id: str, param: str = "conversation_id") -> dict:
        """The conversation object; NotFound (404, naming `param`) when it is missing or
        another tenant's."""
        row = self._one("SELECT created_at, metadata FROM conversations WHERE id=? AND "
                        "tenant=?", (conversation_id, tenant))
        if row is None:
            raise NotFound(f"Conversation with id '{conversation_id}' not found.", param=param)
        return {"id": conversation_id, "object": "conversation", "created_at": row[0],
                "metadata": json.loads(row[1])}

    def update(self, tenant: str, conversation_id: str, metadata: dict) -> dict:
        self.get(tenant, conversation_id)
        with self._lock:
            self._db.execute("UPDATE conversations SET metadata=? WHERE id=?",
                             (_dumps(metadata), conversation_id))
        return self.get(tenant, conversation_id)

    def delete(self, tenant: str, conversation_id: str) -> None:
        def remove(db):
            if not db.execute("DELETE FROM conversations WHERE id=? AND tenant=?",
                              (conversation_id, tenant)).rowcount:
                raise NotFound(f"Conversation with id '{conversation_id}' not found.",
                               param="conversation_id")
            db.execute("DELETE FROM items WHERE conversation_id=?", (conversation_id,))
        self._tx(remove)
        with self._lock:  # its pages, zeroed, leave the WAL too
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # ---------------------------------------------------------------- items

    def add(self, tenant: str, conversation_id: str, items: list[dict],
            param: str = "items") -> None:
        """Append `items` (each with its id); past MAX_ITEMS a 400 naming `param` (as a missing
        conversation is a 404)."""
        self.get(tenant, conversation_id, param)
        self._tx(lambda db: self._append(db, conversation_id, items, param))

    def _append(self, db, conversation_id: str, items: list[dict], param: str) -> None:
        count, last = db.execute("SELECT COUNT(*), COALESCE(MAX(seq), -1) FROM items WHERE "
                                 "conversation_id=?", (conversation_id,)).fetchone()
        if count + len(items) > MAX_ITEMS:
            raise InvalidRequest(f"a conversation holds at most {MAX_ITEMS} items (it has "
                                 f"{count}): start another", param=param)
        rows = [(conversation_id, last + 1 + i, item["id"], _dumps(item))
                for i, item in enumerate(items)]
        added = sum(len(r[3]) for r in rows)
        used = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM items").fetchone()[0]
        if used + added > self.max_bytes:
            raise QuotaExceeded("the conversation store is full: delete conversations")
        db.executemany("INSERT INTO items VALUES (?,?,?,?,?)",
                       [(*r, len(r[3])) for r in rows])

    def items(self, tenant: str, conversation_id: str, param: str = "conversation_id"
              ) -> list[dict]:
        """All its items, oldest first (what a response reads as its history)."""
        self.get(tenant, conversation_id, param)
        with self._lock:
            rows = self._db.execute("SELECT item FROM items WHERE conversation_id=? ORDER BY "
                                    "seq", (conversation_id,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def page(self, tenant: str, conversation_id: str, limit: int, order: str,
             after: str | None) -> Page:
        """`limit` items after the item `after` (400 naming `after` when it is not one of
        them), oldest first (`order` asc) or newest first (desc)."""
        self.get(tenant, conversation_id)
        descending = order == "desc"
        start = None
        if after is not None:
            row = self._one("SELECT seq FROM items WHERE conversation_id=? AND id=?",
                            (conversation_id, after))
            if row is None:
                raise InvalidRequest(f"no item {after!r} in this conversation", param="after")
            start = row[0]
        sql = ("SELECT item FROM items WHERE conversation_id=? AND (? IS NULL OR seq "
               + ("<" if descending else ">") + " ?) ORDER BY seq "
               + ("DESC" if descending else "ASC") + " LIMIT ?")
        with self._lock:
            rows = self._db.execute(sql, (conversation_id, start, start, limit + 1)).fetchall()
        return Page([json.loads(r[0]) for r in rows[:limit]], len(rows) > limit)

    def item(self, tenant: str, conversation_id: str, item_id: str) -> dict:
        self.get(tenant, conversation_id)
        row = self._one("SELECT item FROM items WHERE conversation_id=? AND id=?",
                        (conversation_id, item_id))
        if row is None:
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
        return json.loads(row[0])

    def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> None:
        self.get(tenant, conversation_id)
        with self._lock:
            deleted = self._db.execute("DELETE FROM items WHERE conversation_id=? AND id=?",
                                       (conversation_id, item_id)).rowcount
        if not deleted:
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id")
