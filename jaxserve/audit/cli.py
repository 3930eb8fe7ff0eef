"""`jaxserve audit verify DIR` and `jaxserve audit prune DIR --older-than DAYS`."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxserve.audit.record import AuditError, read_key_file
from jaxserve.audit.verify import prune, verify


def _tenant_days(text: str) -> tuple[str, float]:
    name, sep, days = text.partition("=")
    try:
        if sep and name and float(days) >= 0:
            return name, float(days)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"want TENANT=DAYS (days >= 0), got {text!r}")


def _head(text: str) -> tuple[int, str]:
    seq, sep, digest = text.partition(":")
    if sep and seq.isdigit() and len(digest) == 64:
        return int(seq), digest.lower()
    raise argparse.ArgumentTypeError(f"want SEQ:SHA256 (as verify prints), got {text!r}")


def _key(args) -> bytes | None:
    return read_key_file(args.key_file) if args.key_file is not None else None


def cmd_verify(args) -> int:
    report = verify(args.directory, _key(args), args.head)
    if not report.ok:
        raise AuditError(report.error)  # printed as one line, exit status 1
    print(f"ok: {report.records} records in {len(report.files)} file(s), head seq "
          f"{report.head_seq} sha256 {report.head_hash}")
    if report.leftover:
        print(f"note: {len(report.leftover)} file(s) before the checkpoint are left from an "
              f"interrupted prune; `jaxserve audit prune` removes them")
    return 0


def cmd_prune(args) -> int:
    result = prune(args.directory, args.older_than, dict(args.tenant_days or ()),
                   key=_key(args))
    if not result.removed:
        print("nothing to prune")
    else:
        print(f"removed {len(result.removed)} file(s) ({result.records} records), "
              f"{result.removed[0].name} .. {result.removed[-1].name}; checkpoint "
              f"{result.checkpoint.name}")
    return 0


def add_audit_command(sub) -> None:
    a = sub.add_parser("audit", help="verify or prune an audit log (serve --audit-log DIR)")
    commands = a.add_subparsers(dest="audit_command", required=True)
    v = commands.add_parser("verify", help="check the hash chain: exit 0 intact, 1 naming the "
                                           "first bad file and line")
    v.add_argument("directory", type=Path)
    _add_key_file(v)
    v.add_argument("--head", type=_head, default=None, metavar="SEQ:SHA256",
                   help="a head exported earlier (printed by verify, or GET "
                        "/admin/v1/audit/head): the chain must still hold that record, so "
                        "records cut from the end are found")
    v.set_defaults(func=cmd_verify)
    p = commands.add_parser("prune", help="remove whole files older than the retention, "
                                          "leaving a checkpoint so verify still passes")
    p.add_argument("directory", type=Path)
    p.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                   help="remove files whose every record is older than this many days")
    p.add_argument("--tenant-days", type=_tenant_days, action="append", metavar="TENANT=DAYS",
                   help="that tenant's records are kept this many days instead (repeatable)")
    _add_key_file(p)
    p.set_defaults(func=cmd_prune)


def _add_key_file(parser) -> None:
    parser.add_argument("--key-file", type=Path, default=None, metavar="FILE",
                        help="the HMAC key the log was written with (serve --audit-key-file)")
