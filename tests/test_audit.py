"""The audit log (jaxserve.audit): records and their hash chain across rotated files, restarts and
a crash's cut line, verify naming the first bad file and line for every kind of damage, prune
with its checkpoint (per-tenant retention), the backlog limit, and the `jaxserve audit` CLI."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from jaxserve.audit import (AuditBacklogFull, AuditError, AuditLog, AuditLogConfig, AuditRecord,
                            prune, verify)
from jaxserve.entrypoints.cli import main
from jaxserve.safety import Intervention

SMALL = 4096  # bytes per file: a few records each, so tests rotate


def write_log(directory: Path, count: int, *, tenants=("acme",), max_file_bytes=SMALL,
              start: int = 0) -> None:
    log = AuditLog(AuditLogConfig(directory, max_file_bytes=max_file_bytes))
    for i in range(start, start + count):
        log.write(AuditRecord(f"req-{i}", "/v1/chat/completions", "ok", 200,
                              tenant=tenants[i % len(tenants)], key_id="k1a2b3", model="m",
                              prompt_tokens=i, completion_tokens=2 * i,
                              finish_reasons=["stop"],
                              interventions=[Intervention("emails", "redact", "input")]))
    log.close()


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(directory.glob("audit-*.jsonl"))
            for line in lines(p)]


@pytest.fixture()
def rotated(tmp_path) -> Path:
    """A log of 40 requests over several files."""
    write_log(tmp_path, 40)
    return tmp_path


# ---------------------------------------------------------------- writing


def test_records_chain_across_rotated_files(rotated):
    files = sorted(rotated.glob("audit-*.jsonl"))
    assert len(files) >= 3 and all(p.stat().st_size <= SMALL for p in files)
    recs = records(rotated)
    assert [r["seq"] for r in recs] == list(range(len(recs)))
    assert recs[0]["prev"] == "0" * 64
    assert all(b["prev"] == a["hash"] for a, b in zip(recs, recs[1:]))
    # each full file ends with the record naming the next one, and the chain goes on there
    for path, nxt in zip(files, files[1:]):
        last = json.loads(lines(path)[-1])
        assert last["type"] == "rotate" and last["next"] == nxt.name
        assert json.loads(lines(nxt)[0])["prev"] == last["hash"]
    requests = [r for r in recs if r["type"] == "request"]
    assert [r["request_id"] for r in requests] == [f"req-{i}" for i in range(40)]
    r = requests[3]
    assert (r["tenant"], r["key_id"], r["route"], r["status"], r["status_code"]) == (
        "acme", "k1a2b3", "/v1/chat/completions", "ok", 200)
    assert (r["prompt_tokens"], r["completion_tokens"], r["finish_reasons"]) == (3, 6, ["stop"])
    assert r["interventions"] == [{"rule": "emails", "action": "redact", "stage": "input",
                                   "count": 1}]
    assert "content" not in r and r["ts"].endswith("Z")
    report = verify(rotated)
    assert report.ok and report.records == len(recs) and report.head_hash == recs[-1]["hash"]


def test_no_file_passes_its_size_with_its_rotate_record(tmp_path):
    """Records of every length: the rotate record closing a file fits under max_file_bytes
    too (the check once counted only the record before it)."""
    write_log(tmp_path, 150, tenants=tuple("t" * n for n in range(1, 80, 3)))
    files = sorted(tmp_path.glob("audit-*.jsonl"))
    assert len(files) >= 5 and all(p.stat().st_size <= SMALL for p in files)
    assert all(lines(p)[-1].startswith(b'{"seq"') and b'"type":"rotate"' in lines(p)[-1]
               for p in files[:-1])


def test_content_only_when_given(tmp_path):
    log = AuditLog(AuditLogConfig(tmp_path))
    log.write(AuditRecord("a", "/v1/completions", "ok", prompt=["my [REDACTED:email]"],
                          outputs=["hello"]))
    log.close()
    assert records(tmp_path)[0]["content"] == {"prompt": ["my [REDACTED:email]"],
                                               "outputs": ["hello"]}


def test_a_restart_continues_the_chain(rotated):
    before = records(rotated)
    write_log(rotated, 5, start=40)
    after = records(rotated)
    assert after[:len(before)] == before and after[len(before)]["prev"] == before[-1]["hash"]
    assert verify(rotated).ok


def test_a_line_cut_by_a_crash_is_dropped_and_recorded_on_restart(rotated):
    newest = sorted(rotated.glob("audit-*.jsonl"))[-1]
    with newest.open("ab") as f:
        f.write(b'{"seq":99,"ts":"2026')  # a write the crash interrupted
    report = verify(rotated)
    assert report.error == f"{newest.name}:{len(lines(newest))}: truncated: the last line has " \
                           f"no newline"
    write_log(rotated, 1, start=40)
    recs = records(rotated)
    assert recs[-2]["type"] == "recovered" and recs[-2]["dropped_bytes"] == 20
    assert recs[-1]["request_id"] == "req-40" and verify(rotated).ok


def test_one_writer_per_directory(tmp_path):
    log = AuditLog(AuditLogConfig(tmp_path))
    try:
        with pytest.raises(AuditError, match="in use by another process"):
            AuditLog(AuditLogConfig(tmp_path))
    finally:
        log.close()


def test_backlog_refuses_admission_until_the_writer_catches_up(tmp_path, monkeypatch):
    log = AuditLog(AuditLogConfig(tmp_path, max_pending=3))
    gate = threading.Event()
    append = log._append
    monkeypatch.setattr(log, "_append", lambda batch: (gate.wait(30), append(batch)))
    try:
        for i in range(3):
            log.check_accepting()
            log.write(AuditRecord(f"r{i}", "/v1/completions", "ok"))
        deadline = time.monotonic() + 30
        while log.pending < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(AuditBacklogFull, match="behind"):
            log.check_accepting()
    finally:
        gate.set()
        log.close()
    assert log.pending == 0 and len(records(tmp_path)) == 3 and verify(tmp_path).ok


# ---------------------------------------------------------------- verify finds the damage


def rewrite(path: Path, new_lines: list[bytes]) -> None:
    path.write_bytes(b"".join(new_lines))


def second_file(directory: Path) -> Path:
    return sorted(directory.glob("audit-*.jsonl"))[1]


def test_changed_record(rotated):
    path = second_file(rotated)
    ls = lines(path)
    ls[2] = ls[2].replace(b'"status":"ok"', b'"status":"no"')
    rewrite(path, ls)
    assert verify(rotated).error == (f"{path.name}:3: record changed: its content does not "
                                     f"match its hash")


def test_changed_record_with_its_hash_recomputed(rotated):
    """Whoever edits a record and fixes its own hash still breaks the next record's prev."""
    from jaxserve.audit.record import encode

    path = second_file(rotated)
    ls = lines(path)
    record = json.loads(ls[2])
    record["status"] = "no"
    del record["hash"]
    ls[2] = encode(record)[0] + b"\n"
    rewrite(path, ls)
    assert verify(rotated).error.startswith(f"{path.name}:4: does not follow the record before "
                                            f"it (prev hash mismatch)")


def test_removed_record(rotated):
    path = second_file(rotated)
    ls = lines(path)
    del ls[1]
    rewrite(path, ls)
    assert verify(rotated).error.startswith(f"{path.name}:2: seq ")
    assert "a record was removed or reordered" in verify(rotated).error


def test_reordered_records(rotated):
    path = second_file(rotated)
    ls = lines(path)
    ls[3], ls[4] = ls[4], ls[3]
    rewrite(path, ls)
    assert verify(rotated).error.startswith(f"{path.name}:4: seq ")


def test_truncated_mid_line(rotated):
    path = second_file(rotated)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    error = verify(rotated).error
    n = len(path.read_bytes().split(b"\n"))
    assert error == f"{path.name}:{n}: truncated: the last line has no newline"


def test_whole_lines_cut_from_the_end_of_an_older_file(rotated):
    path = second_file(rotated)
    ls = lines(path)
    rewrite(path, ls[:-2])
    assert verify(rotated).error.startswith(f"{path.name}:{len(ls) - 1}: missing: the file ends "
                                            f"without the rotate record")


def test_a_missing_file(rotated):
    path = second_file(rotated)
    path.unlink()
    assert verify(rotated).error.startswith(f"{path.name}: missing")
    (rotated / "audit-000001.jsonl").unlink()
    assert verify(rotated).error.startswith("audit-000001.jsonl: missing")


# ---------------------------------------------------------------- prune


def test_prune_keeps_the_chain_verifiable(rotated):
    files = sorted(rotated.glob("audit-*.jsonl"))
    recs = records(rotated)
    last_removed = json.loads(lines(files[-2])[-1])
    assert prune(rotated, 30).removed == []  # nothing is 30 days old
    result = prune(rotated, 0, now=time.time() + 60)
    assert result.removed == files[:-1]  # the newest file stays
    assert result.records == len(recs) - len(lines(files[-1]))
    checkpoint = json.loads(result.checkpoint.read_text())
    assert checkpoint["type"] == "checkpoint" and result.checkpoint.name == \
        f"checkpoint-{len(files) - 1:06d}.jsonl"
    assert (checkpoint["last_seq"], checkpoint["last_hash"]) == (last_removed["seq"],
                                                                 last_removed["hash"])
    report = verify(rotated)
    assert report.ok and report.files == files[-1:]
    assert report.head_hash == recs[-1]["hash"]
    # the log grows on, is pruned again, and a second checkpoint replaces the first
    write_log(rotated, 30, start=40)
    result = prune(rotated, 0, now=time.time() + 60)
    assert result.removed and sorted(p.name for p in rotated.glob("checkpoint-*")) == [
        result.checkpoint.name]
    assert verify(rotated).ok
    # a checkpoint edited afterwards is found
    result.checkpoint.write_text(result.checkpoint.read_text().replace('"last_seq":',
                                                                       '"last_seq":1'))
    assert not verify(rotated).ok


def test_prune_honours_each_tenants_retention(tmp_path):
    write_log(tmp_path, 20, tenants=("short",))
    write_log(tmp_path, 1, tenants=("long",), start=20)
    write_log(tmp_path, 20, tenants=("short",), start=21)
    in_a_week = time.time() + 7 * 86400
    long_file = next(p for p in sorted(tmp_path.glob("audit-*.jsonl"))
                     if b'"tenant":"long"' in p.read_bytes())
    result = prune(tmp_path, 1, {"long": 30}, now=in_a_week)
    # files go oldest first, up to the one holding a record "long" must keep
    assert result.removed and result.removed[-1].name < long_file.name
    assert long_file.exists() and verify(tmp_path).ok
    assert prune(tmp_path, 1, {"long": 30}, now=in_a_week).removed == []
    assert long_file in prune(tmp_path, 1, {"long": 5}, now=in_a_week).removed


def test_prune_refuses_a_broken_log(rotated):
    path = second_file(rotated)
    rewrite(path, lines(path)[1:])
    with pytest.raises(AuditError, match="not pruning a log that fails verification"):
        prune(rotated, 0, now=time.time() + 60)
    assert path.exists()


# ---------------------------------------------------------------- the CLI


def test_audit_cli_exit_codes(rotated, capsys):
    assert main(["audit", "verify", str(rotated)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    assert main(["audit", "prune", str(rotated), "--older-than", "30",
                 "--tenant-days", "acme=60"]) == 0
    assert capsys.readouterr().out == "nothing to prune\n"
    assert main(["audit", "prune", str(rotated), "--older-than", "0"]) == 0
    assert capsys.readouterr().out.startswith("removed ")
    assert main(["audit", "verify", str(rotated)]) == 0
    newest = sorted(rotated.glob("audit-*.jsonl"))[-1]
    ls = lines(newest)
    rewrite(newest, [ls[1], ls[0], *ls[2:]])
    capsys.readouterr()
    assert main(["audit", "verify", str(rotated)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {newest.name}:1: seq ")
    assert main(["audit", "verify", str(rotated / "nope")]) == 1
    with pytest.raises(SystemExit) as e:  # argparse: a usage error
        main(["audit", "prune", str(rotated), "--older-than", "1", "--tenant-days", "acme"])
    assert e.value.code == 2


def test_a_failed_write_is_retried_without_a_gap_or_a_duplicate(tmp_path, monkeypatch):
    import errno
    import os

    from jaxserve.audit import log as audit_log

    log = AuditLog(AuditLogConfig(tmp_path))
    log.write(AuditRecord("before", "/v1/completions", "ok"))
    deadline = time.monotonic() + 30
    while log.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    failed, real_write = threading.Event(), os.write

    def write_half_then_fail(fd, data):  # a disk that fills up mid-write
        if not failed.is_set():
            failed.set()
            real_write(fd, bytes(data[:10]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(audit_log.os, "write", write_half_then_fail)
    log.write(AuditRecord("during", "/v1/completions", "ok"))
    assert failed.wait(30)
    while log._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(AuditBacklogFull, match="No space left on device"):
        log.check_accepting()
    log.close()  # the retry a second later succeeds
    assert [r["request_id"] for r in records(tmp_path)] == ["before", "during"]
    assert verify(tmp_path).ok


# ---------------------------------------------------------------- tampering verify must see
# (review a70e490, M5)


def test_the_newest_file_deleted_is_found(rotated):
    newest = sorted(rotated.glob("audit-*.jsonl"))[-1]
    newest.unlink()
    assert verify(rotated).error.startswith(f"{newest.name}: missing (the file before it ends "
                                            f"with the rotate record naming it)")


def forge_checkpoint(directory: Path, number: int, key: bytes | None = None) -> Path:
    from jaxserve.audit.record import encode

    line, _ = encode({"type": "checkpoint", "ts": "2026-11-27T00:00:00.000Z", "last_seq": 0,
                      "last_hash": "0" * 64, "through": f"audit-{number:06d}.jsonl",
                      "records_removed": 1}, key)
    path = directory / f"checkpoint-{number:06d}.jsonl"
    path.write_bytes(line + b"\n")
    return path


def test_a_checkpoint_past_the_newest_file_is_refused_and_prune_deletes_nothing(rotated):
    path = second_file(rotated)
    ls = lines(path)
    ls[2] = ls[2].replace(b'"status":"ok"', b'"status":"no"')
    rewrite(path, ls)
    newest = sorted(rotated.glob("audit-*.jsonl"))[-1]
    forge_checkpoint(rotated, 999999)
    report = verify(rotated)
    assert not report.ok and report.error.startswith(
        "checkpoint-999999.jsonl: names audit-999999.jsonl, at or after the newest file")
    before = sorted(rotated.iterdir())
    with pytest.raises(AuditError, match="not pruning a log that fails verification"):
        prune(rotated, 3650, now=time.time() + 60)
    assert sorted(rotated.iterdir()) == before and newest.exists()
    # one naming the newest file itself leaves no chain to verify: refused as well
    (rotated / "checkpoint-999999.jsonl").unlink()
    forge_checkpoint(rotated, int(newest.stem.split("-")[1]))
    assert verify(rotated).error.startswith(f"checkpoint-{newest.stem.split('-')[1]}.jsonl: "
                                            f"names {newest.name}, at or after the newest file")


def test_a_keyed_log_finds_a_chain_rewritten_without_its_key(tmp_path):
    from jaxserve.audit.record import encode

    key = b"k" * 32
    log = AuditLog(AuditLogConfig(tmp_path, max_file_bytes=SMALL, key=key))
    for i in range(30):
        log.write(AuditRecord(f"req-{i}", "/v1/completions", "ok", 200, tenant="acme"))
    log.close()
    assert verify(tmp_path, key=key).ok
    assert verify(tmp_path).error.startswith("audit-000001.jsonl:1: keyed record")
    assert verify(tmp_path, key=b"x" * 32).error.startswith(
        "audit-000001.jsonl:1: record changed")
    # whoever can write the directory but lacks the key rewrites the chain from the start
    prev, out = "0" * 64, []
    for r in records(tmp_path):
        del r["hmac"]
        r["prev"], r["tenant"] = prev, "mallory"
        line, prev = encode(r)
        out.append(line + b"\n")
    for p in sorted(tmp_path.glob("audit-*.jsonl")):
        p.unlink()
    (tmp_path / "audit-000001.jsonl").write_bytes(b"".join(out))
    assert verify(tmp_path).ok  # plain sha256: consistent, but not the key's
    assert verify(tmp_path, key=key).error.startswith(
        "audit-000001.jsonl:1: not keyed: this log's key signs every record")
    with pytest.raises(AuditError, match="written without a key"):
        AuditLog(AuditLogConfig(tmp_path, key=key))


def test_prune_of_a_keyed_log_signs_its_checkpoint(tmp_path):
    key = b"k" * 32
    log = AuditLog(AuditLogConfig(tmp_path, max_file_bytes=SMALL, key=key))
    for i in range(30):
        log.write(AuditRecord(f"req-{i}", "/v1/completions", "ok", 200, tenant="acme"))
    log.close()
    with pytest.raises(AuditError, match="keyed record"):
        prune(tmp_path, 0, now=time.time() + 60)
    assert prune(tmp_path, 0, now=time.time() + 60, key=key).removed
    assert verify(tmp_path, key=key).ok
    forge_checkpoint(tmp_path, 1)  # older than the real one: not the newest, ignored ...
    assert verify(tmp_path, key=key).ok
    for p in tmp_path.glob("checkpoint-*"):
        p.unlink()
    forge_checkpoint(tmp_path, int(sorted(tmp_path.glob("audit-*"))[0].stem[-6:]) - 1)
    assert "not keyed" in verify(tmp_path, key=key).error  # ... and a forged one fails


def test_verify_against_an_exported_head_finds_records_cut_from_the_end(rotated):
    report = verify(rotated)
    head = (report.head_seq, report.head_hash)
    assert verify(rotated, head=head).ok
    assert verify(rotated, head=(report.head_seq - 3, records(rotated)[-4]["hash"])).ok
    assert verify(rotated, head=(report.head_seq - 3, "f" * 64)).error.startswith(
        f"record seq {report.head_seq - 3} has hash ")
    newest = sorted(rotated.glob("audit-*.jsonl"))[-1]
    rewrite(newest, lines(newest)[:-2])
    assert verify(rotated).ok  # a hash chain alone cannot see it
    assert verify(rotated, head=head).error == (
        f"the chain ends at seq {report.head_seq - 2}, before the exported head (seq "
        f"{report.head_seq}): records were cut from the end")


def test_audit_cli_key_file_and_head(tmp_path, capsys):
    key_file = tmp_path / "audit.key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    directory = tmp_path / "log"
    log = AuditLog(AuditLogConfig(directory, key=key_file.read_bytes().strip()))
    log.write(AuditRecord("r", "/v1/completions", "ok", 200))
    log.close()
    assert main(["audit", "verify", str(directory)]) == 1
    assert main(["audit", "verify", str(directory), "--key-file", str(key_file)]) == 0
    out = capsys.readouterr().out
    seq, digest = out.split("head seq ")[1].split()[0], out.split("sha256 ")[1].split()[0]
    assert main(["audit", "verify", str(directory), "--key-file", str(key_file),
                 "--head", f"{seq}:{digest}"]) == 0
    assert main(["audit", "verify", str(directory), "--key-file", str(key_file),
                 "--head", f"{int(seq) + 1}:{digest}"]) == 1
    short = tmp_path / "short.key"
    short.write_text("abc")
    assert main(["audit", "verify", str(directory), "--key-file", str(short)]) == 1
    assert "at least 16 bytes" in capsys.readouterr().err
