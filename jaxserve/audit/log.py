"""AuditLog: the writer behind `--audit-log DIR`.

`write(record)` only puts the record on a queue (it never blocks the event loop); one writer
thread stamps each with its sequence number and the previous record's hash, appends it to the
newest file and makes it durable: group commit, i.e. it writes everything that has queued up in
one `write` and then `fsync`s, so a record reaches the disk within one write + fsync of being
queued, and a burst shares one fsync. A crash therefore loses only the records still queued and
the batch being written: at most `max_pending` (admission refuses new requests while that many
wait: `check_accepting`), in practice those of the last few milliseconds. `close()` writes the
rest and syncs.

Files are `audit-000001.jsonl`, `audit-000002.jsonl`, ...: when the next record and the rotate
record after it would push a file past `max_file_bytes`, a `rotate` record naming the next file
closes it, and the chain goes on in the next. On start the writer continues the newest file; a
last line cut by a crash is removed and a `recovered` record says how many bytes were dropped.
One process at a time: the directory is locked (`.lock`).

Refusals nobody can be held to (refusals.py) are counted and written as one `refusals` summary per
client and interval (`summary_interval_s`), not a record each. The log's disk use is bounded:
`max_bytes` (its files' total; None: no cap) and `min_free_bytes` (what it leaves free on the
filesystem): once either is reached `check_accepting` refuses (fail closed: no call goes
unrecorded); before that, at 80 % of the cap or under twice the free reserve, it warns once, and
`headroom` (the metric jaxserve:audit_log_headroom_bytes) says how far it is from full.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Gauge

from jaxserve.audit.refusals import RefusalCounts
from jaxserve.audit.record import (GENESIS, AdminRecord, AuditError, AuditRecord, KeyMismatch,
                                   StepRecord, data_file_name, decode, encode, list_files,
                                   read_key_file, utc_now)
from jaxserve.errors import ConfigError, EngineOverloaded

log = logging.getLogger(__name__)


class AuditBacklogFull(EngineOverloaded):
    """The audit writer is behind (or failing): new requests wait until it catches up."""


@dataclass(frozen=True)
class AuditLogConfig:
    directory: Path
    max_file_bytes: int = 64 * 2**20
    max_pending: int = 4096  # queued records beyond which check_accepting refuses
    fsync: bool = True  # False: a process crash loses nothing written, an OS crash may
    key: bytes | None = None  # HMAC key (--audit-key-file): every line keyed (record.py)
    max_bytes: int | None = None  # the files' total, beyond which it refuses (None: no cap)
    min_free_bytes: int = 256 * 2**20  # left free on the filesystem: refuses below it
    summary_interval_s: float = 60.0  # one refusals summary per client per interval
    max_summary_clients: int = 1024  # per interval; later clients share one summary

    def __post_init__(self):
        if self.max_file_bytes < 4096:
            raise ConfigError(f"max_file_bytes must be >= 4096, got {self.max_file_bytes}")
        if self.max_pending < 1:
            raise ConfigError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.max_bytes is not None and self.max_bytes < 4096:
            raise ConfigError(f"the audit log's max_bytes must be >= 4096, got {self.max_bytes}")
        if self.min_free_bytes < 0 or not self.summary_interval_s > 0:
            raise ConfigError("min_free_bytes must be >= 0 and summary_interval_s > 0")


def audit_log_config(directory: str | Path | None, key_file: str | Path | None = None,
                     max_bytes: int | None = None,
                     min_free_bytes: int | None = None) -> AuditLogConfig | None:
    """The log of the flags (--audit-log, --audit-key-file, --audit-max-bytes,
    --audit-min-free-bytes); None without a directory."""
    if directory is None:
        if key_file is not None or max_bytes is not None or min_free_bytes is not None:
            raise ConfigError("--audit-key-file, --audit-max-bytes and --audit-min-free-bytes "
                              "need --audit-log")
        return None
    options = {"max_bytes": max_bytes}
    if key_file is not None:
        options["key"] = read_key_file(key_file)
    if min_free_bytes is not None:
        options["min_free_bytes"] = min_free_bytes
    return AuditLogConfig(Path(directory), **options)


_STOP = object()
_TICK_S = 1.0  # the idle writer wakes this often: summaries due, disk use rescanned
_RESCAN_S = 5.0  # the directory's size read again (a prune by another process frees space)
_WARN_FRACTION = 0.8  # of max_bytes: warn from here


class AuditLog:
    def __init__(self, config: AuditLogConfig):
        self.config = config
        self.directory = Path(config.directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise AuditError(f"cannot open the audit log {self.directory}: {e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise AuditError(f"the audit log {self.directory} is in use by another process") \
                from None
        try:
            dropped = self._open_tail()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._in_hand = 0  # records taken off the queue, not yet written
        self._error: str | None = None
        self._closed = False
        self._refusals = RefusalCounts(config.max_summary_clients)
        self._head = (self._seq - 1, self._prev) if self._seq else None
        self._used, self._free = 0, 0  # bytes: the log's files, free on the filesystem
        self._level = "ok"  # "ok" | "low" | "full": what was last logged
        self._rescan()
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()
        if dropped:
            self._queue.put({"type": "recovered", "ts": utc_now(), "dropped_bytes": dropped})

    # ---- the caller's side (any thread, never blocks) -----------------------------------------

    def write(self, record: AuditRecord | AdminRecord | StepRecord) -> None:
        if self._closed:
            raise AuditError("the audit log is closed")
        self._queue.put({"type": record.kind, "ts": utc_now(), **record.to_dict()})

    @property
    def head(self) -> tuple[int, str] | None:
        """(seq, hash) of the last record written and synced; None while the log is empty. Kept
        elsewhere, it lets `verify --head` find records cut from the end, or a rewritten chain."""
        return self._head

    def count_refusal(self, client: str | None, tenant: str | None, status: str, route: str,
                      key_id: str | None) -> None:
        """A refusal nobody can be held to: counted in its client's next summary."""
        self._refusals.count(client, tenant, status, route, key_id)

    def write_summaries(self) -> None:
        """Queue the refusals summaries counted so far (the writer does every interval)."""
        for body in self._refusals.take():
            self._queue.put(body)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def headroom(self) -> int:
        """Bytes the log may still write before it refuses new calls (<= 0: full)."""
        room = self._free - self.config.min_free_bytes
        if self.config.max_bytes is not None:
            room = min(room, self.config.max_bytes - self._used)
        return room

    def register_metrics(self, registry) -> None:
        """jaxserve:audit_log_bytes and jaxserve:audit_log_headroom_bytes in `registry`."""
        Gauge("jaxserve:audit_log_bytes", "Bytes of the audit log's files.",
              registry=registry).set_function(lambda: self._used)
        Gauge("jaxserve:audit_log_headroom_bytes", "Bytes the audit log may still write before "
              "it refuses new calls (max_bytes, min_free_bytes); <= 0: full.",
              registry=registry).set_function(lambda: self.headroom)

    @property
    def pending(self) -> int:
        return self._queue.qsize() + self._in_hand

    def check_accepting(self) -> None:
        """Raise AuditBacklogFull (a 503) while records cannot be written fast enough, so a crash
        never loses more than `max_pending` of them."""
        if self._error is not None:
            raise AuditBacklogFull(f"the audit log cannot be written ({self._error}); retry later")
        if self.headroom <= 0:
            raise AuditBacklogFull("the audit log is full; retry later")
        if self.pending >= self.config.max_pending:
            raise AuditBacklogFull("the audit log is behind; retry later")

    def close(self) -> None:
        """Write what is queued, sync, and stop the writer."""
        if self._closed:
            return
        self._closed = True
        self.write_summaries()
        self._queue.put(_STOP)
        self._thread.join()
        os.close(self._fd)
        os.close(self._lock_fd)

    # ---- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        batch: list[dict] = []
        now = time.monotonic()
        summaries_due, rescan_due = now + self.config.summary_interval_s, now + _RESCAN_S
        while not (stopping and not batch):
            now = time.monotonic()
            if now >= summaries_due:
                summaries_due = now + self.config.summary_interval_s
                self.write_summaries()
            if now >= rescan_due:
                rescan_due = now + _RESCAN_S
                self._rescan()
            if not batch:
                try:
                    item = self._queue.get(timeout=_TICK_S)
                except queue.Empty:
                    continue
                if item is _STOP:
                    stopping = True
                    continue
                batch.append(item)
            while True:  # everything queued so far goes in this write
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
            self._in_hand = len(batch)
            try:
                self._append(batch)
            except OSError as e:
                self._error = e.strerror or str(e)
                log.error("audit log write failed (%s); retrying in 1 s", self._error)
                self._rescan()
                time.sleep(1.0)
                continue
            self._error = None
            batch = []
            self._in_hand = 0
            self._head = (self._seq - 1, self._prev)
            self._free = _free_bytes(self.directory)
            self._log_level()

    def _rescan(self) -> None:
        """The log's disk use and the filesystem's free space, read afresh."""
        data, checkpoints = list_files(self.directory)
        used = 0
        for _, path in data + checkpoints:
            try:
                used += path.stat().st_size
            except FileNotFoundError:  # pruned meanwhile
                pass
        self._used, self._free = used, _free_bytes(self.directory)
        self._log_level()

    def _log_level(self) -> None:
        """Log (once per change) the log nearing full, full, or back under its limits."""
        cap, reserve = self.config.max_bytes, self.config.min_free_bytes
        if self.headroom <= 0:
            level = "full"
        elif (cap is not None and self._used >= _WARN_FRACTION * cap) or self._free < 2 * reserve:
            level = "low"
        else:
            level = "ok"
        if level == self._level:
            return
        self._level = level
        where = (f"{self._used} bytes used of {cap if cap is not None else 'no'} cap, "
                 f"{self._free} bytes free on the disk (reserve {reserve})")
        if level == "full":
            log.error("the audit log is full (%s): every audited call is refused (503) until "
                      "it is pruned (`jaxserve audit prune %s`)", where, self.directory)
        elif level == "low":
            log.warning("the audit log is nearly full (%s): prune it (`jaxserve audit prune "
                        "%s`) before new calls are refused", where, self.directory)
        else:
            log.info("the audit log is under its limits again (%s)", where)

    def _append(self, batch: list[dict]) -> None:
        """Write the batch (rotating as needed) and sync; on OSError the files and the chain
        state are as before the call, so the batch can be retried."""
        state = (self._number, self._size, self._seq, self._prev)
        try:
            lines: list[bytes] = []
            for body in batch:
                before = (self._size, self._seq, self._prev)
                line = self._line(body)
                # Room must stay for the rotate record that would close the file after this one
                # (its size is known now: seq, prev and next fixed, ts of fixed width).
                closing = len(encode(self._record(self._rotate(body["ts"])), self.config.key)[0])
                if self._size + closing + 1 > self.config.max_file_bytes and before[0] > 0:
                    self._size, self._seq, self._prev = before  # it goes to the next file
                    lines.append(self._line(self._rotate(body["ts"])))
                    self._flush(lines)
                    self._next_file()
                    line = self._line(body)
                lines.append(line)
            self._flush(lines)
        except OSError:
            os.close(self._fd)
            self._number, self._size, self._seq, self._prev = state
            self._fd = os.open(self.directory / data_file_name(self._number),
                               os.O_WRONLY | os.O_APPEND)
            os.ftruncate(self._fd, self._size)
            raise

    def _rotate(self, ts: str) -> dict:
        return {"type": "rotate", "ts": ts, "next": data_file_name(self._number + 1)}

    def _record(self, body: dict) -> dict:
        """body as the next chained record (seq, ts, type and prev first)."""
        record = {"seq": self._seq, "ts": body["ts"], "type": body["type"], "prev": self._prev}
        record.update((k, v) for k, v in body.items() if k not in ("ts", "type"))
        return record

    def _line(self, body: dict) -> bytes:
        """The next chained line for body."""
        line, self._prev = encode(self._record(body), self.config.key)
        self._seq += 1
        self._size += len(line) + 1
        return line

    def _flush(self, lines: list[bytes]) -> None:
        data = b"".join(line + b"\n" for line in lines)
        lines.clear()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            self._used += written
            view = view[written:]
        if self.config.fsync:
            os.fsync(self._fd)

    def _next_file(self) -> None:
        self._number += 1
        fd = os.open(self.directory / data_file_name(self._number),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(self._fd)
        self._fd, self._size = fd, 0
        if self.config.fsync:
            _fsync_dir(self.directory)

    # ---- start: continue the chain where it ends ----------------------------------------------

    def _open_tail(self) -> int:
        """Open the newest file for appending and load the chain's state; returns how many bytes
        of a cut last line were dropped."""
        data, _ = list_files(self.directory)
        self._number, self._seq, self._prev = 1, 0, GENESIS
        dropped = 0
        for number, path in reversed(data):
            raw = path.read_bytes()
            cut = raw.rfind(b"\n") + 1
            if cut < len(raw) and number == data[-1][0]:
                dropped = len(raw) - cut
                os.truncate(path, cut)
                log.warning("audit log %s: dropped %d bytes of a record cut by a crash", path,
                            dropped)
            if cut == 0:
                continue  # empty: take the chain from the file before
            last = raw[raw.rfind(b"\n", 0, cut - 1) + 1:cut - 1]
            try:
                record, digest = decode(last, self.config.key)
                self._seq, self._prev = int(record["seq"]) + 1, digest
            except KeyMismatch:
                raise AuditError(f"{self.directory} was written "
                                 f"{'with' if self.config.key is None else 'without'} a key; "
                                 f"give the same --audit-key-file, or start a new directory") \
                    from None
            except (ValueError, KeyError, TypeError) as e:
                raise AuditError(f"{path}: the last record is damaged ({e}); run `jaxserve "
                                 f"audit verify {self.directory}`") from None
            self._number = number + 1 if record.get("type") == "rotate" else number
            break
        if data:
            self._number = max(self._number, data[-1][0])
        path = self.directory / data_file_name(self._number)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size
        return dropped


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
