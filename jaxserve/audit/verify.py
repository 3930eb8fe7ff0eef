"""`jaxserve audit verify DIR` and `jaxserve audit prune DIR --older-than DAYS`.

verify walks the chain from its start — the first file (its first record's `prev` is 64 zeros)
or, after a prune, the newest checkpoint — through every file, and stops at the first line that
is not a record, whose hash does not match its content, whose `seq` is not the next one or whose
`prev` is not the previous record's hash; a file other than the newest must end with the
`rotate` record naming the next file, and the newest must not (the file it names was
removed). So a record changed, removed or moved, a file cut short (mid-line, or whole lines
before its rotate record) or missing, the newest included, is found and named by file and line.
A checkpoint must name a file before the newest (one at or past it would leave no chain, or hide
every file). A hash chain alone cannot see whole records cut from the end of the newest file,
and whoever can write the directory can rewrite it all: keep the head (`seq:hash`, which verify
prints and the admin API's GET /admin/v1/audit/head gives) somewhere else and pass it as
`head`, and key the log (`key`: an HMAC key, --audit-key-file) so that it cannot be recomputed.

prune removes whole files, oldest first, while every record in a file is older than its
tenant's retention (`tenant_days`, else `older_than_days`); it never removes the newest file.
Before deleting, it writes `checkpoint-<N>.jsonl` (N: the last removed file's number) holding the
last removed record's seq and hash, from which verify then starts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from jaxserve.audit.record import (GENESIS, AuditError, checkpoint_file_name, data_file_name,
                                   decode, encode, list_files, parse_time, utc_now)

_DAY = 86400.0


@dataclass(frozen=True)
class VerifyReport:
    files: list[Path] = field(default_factory=list)  # the chain's files, in order
    records: int = 0
    head_seq: int | None = None  # the last record's seq and hash
    head_hash: str | None = None
    error: str | None = None  # "FILE:LINE: what is wrong", the first problem found
    leftover: list[Path] = field(default_factory=list)  # before the checkpoint: prune again

    @property
    def ok(self) -> bool:
        return self.error is None


def _records(path: Path, key: bytes | None):
    """(line number, record, hash) for each line; ValueError('LINE: ...') at the first bad one."""
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines[:-1], 1):
        try:
            record, digest = decode(line, key)
        except ValueError as e:
            raise ValueError(f"{number}: {e}") from None
        yield number, record, digest
    if lines[-1]:
        raise ValueError(f"{len(lines)}: truncated: the last line has no newline")


def _checkpoint(path: Path, key: bytes | None) -> tuple[int, str]:
    try:
        (_, record, _), = list(_records(path, key))
        return int(record["last_seq"]), str(record["last_hash"])
    except (ValueError, KeyError, TypeError) as e:
        raise AuditError(f"{path.name}: not a valid checkpoint ({e})") from None


def verify(directory: Path, key: bytes | None = None,
           head: tuple[int, str] | None = None) -> VerifyReport:
    """`key`: the log's HMAC key (None: an unkeyed log); `head`: (seq, hash) of a record exported
    earlier, which the chain must still hold."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AuditError(f"{directory} is not a directory")
    data, checkpoints = list_files(directory)
    if not data:
        raise AuditError(f"{directory} holds no audit files (audit-NNNNNN.jsonl)")
    seq, prev, first = 0, GENESIS, 1
    if checkpoints:
        number, path = checkpoints[-1]
        if number >= data[-1][0]:
            return VerifyReport(error=f"{path.name}: names {data_file_name(number)}, at or after "
                                      f"the newest file {data[-1][1].name}: not a checkpoint "
                                      f"prune wrote")
        try:
            last_seq, prev = _checkpoint(path, key)
        except AuditError as e:
            return VerifyReport(error=str(e))
        seq, first = last_seq + 1, number + 1
    leftover = [p for n, p in data if n < first]
    chain = [(n, p) for n, p in data if n >= first]
    files, count, head_found = [], 0, None

    def report(error: str | None = None) -> VerifyReport:
        return VerifyReport(files, count, seq - 1 if count else None, prev if count else None,
                            error, leftover)

    for i, (number, path) in enumerate(chain):
        expected = first + i
        if number != expected:
            return report(f"{data_file_name(expected)}: missing (the chain goes on in "
                          f"{path.name})")
        files.append(path)
        last, line_no = None, 0
        try:
            for line_no, record, digest in _records(path, key):
                if record.get("seq") != seq:
                    return report(f"{path.name}:{line_no}: seq {record.get('seq')} where "
                                  f"{seq} should be: a record was removed or reordered")
                if record.get("prev") != prev:
                    return report(f"{path.name}:{line_no}: does not follow the record before it "
                                  f"(prev hash mismatch): a record was changed, removed or "
                                  f"reordered")
                if head is not None and seq == head[0]:
                    head_found = digest
                seq, prev, last = seq + 1, digest, record
                count += 1
        except ValueError as e:
            return report(f"{path.name}:{e}")
        following = data_file_name(number + 1)
        rotated = last is not None and last.get("type") == "rotate"
        if i + 1 < len(chain) and (not rotated or last.get("next") != following):
            return report(f"{path.name}:{line_no + 1}: missing: the file ends without the "
                          f"rotate record naming {following} (truncated)")
        if i + 1 == len(chain) and rotated:
            return report(f"{last.get('next')}: missing (the file before it ends with the rotate "
                          f"record naming it)")
    if head is not None:
        if head_found is None:
            return report(f"the chain ends at seq {seq - 1}, before the exported head (seq "
                          f"{head[0]}): records were cut from the end")
        if head_found != head[1]:
            return report(f"record seq {head[0]} has hash {head_found}, not the exported "
                          f"head's {head[1]}: the chain was rewritten")
    return report()


@dataclass(frozen=True)
class PruneReport:
    removed: list[Path]
    records: int  # records in the removed files
    checkpoint: Path | None


def prune(directory: Path, older_than_days: float,
          tenant_days: Mapping[str, float] | None = None, now: float | None = None,
          key: bytes | None = None) -> PruneReport:
    """Remove the oldest files whose every record is past retention (see the module doc). The
    log must verify first (with its `key`, which signs the checkpoint): pruning never hides a
    broken chain, and never removes the newest file."""
    directory = Path(directory)
    if older_than_days < 0:
        raise AuditError(f"--older-than must be >= 0 days, got {older_than_days}")
    report = verify(directory, key)
    if not report.ok:
        raise AuditError(f"not pruning a log that fails verification: {report.error}")
    now = time.time() if now is None else now
    tenant_days = tenant_days or {}

    def expired(record: dict) -> bool:
        days = tenant_days.get(record.get("tenant"), older_than_days)
        return parse_time(record["ts"]) + days * _DAY < now

    removable, records, last = [], 0, None
    for path in report.files[:-1]:  # the newest file is the one being written
        rows = list(_records(path, key))
        if not all(expired(r) for _, r, _ in rows):
            break
        removable.append(path)
        records += len(rows)
        last = rows[-1]
    for path in report.leftover:  # left by a prune that was interrupted
        path.unlink()
    if not removable:
        return PruneReport([], 0, None)
    number = int(removable[-1].stem.split("-")[1])
    _, last_record, last_hash = last
    line, _ = encode({"type": "checkpoint", "ts": utc_now(), "last_seq": last_record["seq"],
                      "last_hash": last_hash, "through": removable[-1].name,
                      "records_removed": records}, key)
    checkpoint = directory / checkpoint_file_name(number)
    tmp = checkpoint.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(line + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint)
    for path in removable:
        path.unlink()
    for n, path in list_files(directory)[1]:
        if n < number:
            path.unlink()
    return PruneReport(removable, records, checkpoint)
