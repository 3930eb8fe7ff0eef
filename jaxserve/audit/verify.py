"""`jaxserve audit verify DIR` and `jaxserve audit prune DIR --older-than DAYS`.

verify walks the chain from its start — the first file (its first record's `prev` is 64 zeros)
or, after a prune, the newest checkpoint — through every file, and stops at the first line that
is not a record, whose hash does not match its content, whose `seq` is not the next one or whose
`prev` is not the previous record's hash; a file other than the newest must end with the
`rotate` record naming the next file. So a record changed, removed or moved, a file cut short
(mid-line, or whole lines before its rotate record) or missing is found and named by file and
line. A hash chain alone cannot see whole records cut from the end of the newest file: keep the
head hash that verify prints somewhere else if that matters.

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


def _records(path: Path):
    """(line number, record, hash) for each line; ValueError('LINE: ...') at the first bad one."""
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines[:-1], 1):
        try:
            record, digest = decode(line)
        except ValueError as e:
            raise ValueError(f"{number}: {e}") from None
        yield number, record, digest
    if lines[-1]:
        raise ValueError(f"{len(lines)}: truncated: the last line has no newline")


def _checkpoint(path: Path) -> tuple[int, str]:
    try:
        (_, record, _), = list(_records(path))
        return int(record["last_seq"]), str(record["last_hash"])
    except (ValueError, KeyError, TypeError) as e:
        raise AuditError(f"{path.name}: not a valid checkpoint ({e})") from None


def verify(directory: Path) -> VerifyReport:
    directory = Path(directory)
    if not directory.is_dir():
        raise AuditError(f"{directory} is not a directory")
    data, checkpoints = list_files(directory)
    if not data:
        raise AuditError(f"{directory} holds no audit files (audit-NNNNNN.jsonl)")
    seq, prev, first = 0, GENESIS, 1
    if checkpoints:
        number, path = checkpoints[-1]
        try:
            last_seq, prev = _checkpoint(path)
        except AuditError as e:
            return VerifyReport(error=str(e))
        seq, first = last_seq + 1, number + 1
    leftover = [p for n, p in data if n < first]
    chain = [(n, p) for n, p in data if n >= first]
    files, count = [], 0

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
            for line_no, record, digest in _records(path):
                if record.get("seq") != seq:
                    return report(f"{path.name}:{line_no}: seq {record.get('seq')} where "
                                  f"{seq} should be: a record was removed or reordered")
                if record.get("prev") != prev:
                    return report(f"{path.name}:{line_no}: does not follow the record before it "
                                  f"(prev hash mismatch): a record was changed, removed or "
                                  f"reordered")
                seq, prev, last = seq + 1, digest, record
                count += 1
        except ValueError as e:
            return report(f"{path.name}:{e}")
        following = data_file_name(number + 1)
        if i + 1 < len(chain) and (last is None or last.get("type") != "rotate"
                                   or last.get("next") != following):
            return report(f"{path.name}:{line_no + 1}: missing: the file ends without the "
                          f"rotate record naming {following} (truncated)")
    return report()


@dataclass(frozen=True)
class PruneReport:
    removed: list[Path]
    records: int  # records in the removed files
    checkpoint: Path | None


def prune(directory: Path, older_than_days: float,
          tenant_days: Mapping[str, float] | None = None, now: float | None = None) -> PruneReport:
    """Remove the oldest files whose every record is past retention (see the module doc). The
    log must verify first: pruning never hides a broken chain."""
    directory = Path(directory)
    if older_than_days < 0:
        raise AuditError(f"--older-than must be >= 0 days, got {older_than_days}")
    report = verify(directory)
    if not report.ok:
        raise AuditError(f"not pruning a log that fails verification: {report.error}")
    now = time.time() if now is None else now
    tenant_days = tenant_days or {}

    def expired(record: dict) -> bool:
        days = tenant_days.get(record.get("tenant"), older_than_days)
        return parse_time(record["ts"]) + days * _DAY < now

    removable, records, last = [], 0, None
    for path in report.files[:-1]:  # the newest file is the one being written
        rows = list(_records(path))
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
                      "records_removed": records})
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
