"""The audit log's lines: what a request record holds, and how a line carries its hash.

A line is one JSON object (ASCII, no spaces) whose last member is `"hash"`: the sha256 of the
line's bytes with that member removed (`{...,"hash":"<hex>"}` -> `{...}`). Hashing the bytes as
written needs no canonical JSON. Every chained line also has `seq` (0, 1, 2, ... across files)
and `prev` (the previous line's hash; 64 zeros for the first line ever).

A keyed log (`--audit-key-file`) ends each line with `"hmac"` instead: HMAC-SHA256 of the same
bytes under the key, so whoever can write the directory but lacks the key cannot rewrite the
chain and recompute it; a keyed log holds only keyed lines.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Sequence

from jaxserve.errors import JaxServeError
from jaxserve.safety.rules import Intervention

GENESIS = "0" * 64
_HASH_SUFFIX = re.compile(rb',"(hash|hmac)":"([0-9a-f]{64})"\}$')
MIN_KEY_BYTES = 16
_DATA_FILE = re.compile(r"^audit-(\d{6,})\.jsonl$")
_CHECKPOINT_FILE = re.compile(r"^checkpoint-(\d{6,})\.jsonl$")


class AuditError(JaxServeError):
    """The audit log cannot be opened, verified or pruned."""


class KeyMismatch(ValueError):
    """A line keyed where the reader has no key, or plain where the reader's key signs all."""


@dataclass(frozen=True)
class AuditRecord:
    """One request, as the audit log keeps it: who asked, what was served and what the policy
    did; no prompt or output text unless the tenant asked for it (`prompt`/`outputs`, given
    after redaction)."""

    kind: ClassVar[str] = "request"  # the line's `type`
    request_id: str
    route: str  # the HTTP path, "grpc:Generate", "grpc:Embed", "batch:<url>"
    status: str  # "ok", "error", "client_disconnected", ... (as the access log)
    status_code: int | None = None  # HTTP status, or the equivalent for gRPC and batch
    tenant: str | None = None
    key_id: str | None = None  # a short hash of the API key, never the key
    model: str | None = None
    version: str | None = None  # the model version that answered
    client: str | None = None  # the client's address
    arrival: float | None = None  # unix time the request arrived
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None  # USD
    finish_reasons: Sequence[str] = ()
    interventions: Sequence[Intervention] = ()
    deadline_exceeded: bool = False
    shed: bool = False
    idempotent_replay: bool = False
    cached: bool = False  # answered from the response cache (no tokens computed, cost 0)
    prompt: Sequence[str] | None = None  # only with the tenant's audit_content, redacted
    outputs: Sequence[str] | None = None  # idem, one per choice
    cached_tokens: int = 0  # of prompt_tokens, read from the prefix cache
    degraded: Sequence[str] = ()  # why its route degraded it under overload (fleet/degrade.py)

    def to_dict(self) -> dict:
        d = {"request_id": self.request_id, "route": self.route, "status": self.status,
             "status_code": self.status_code, "tenant": self.tenant, "key_id": self.key_id,
             "model": self.model, "version": self.version, "client": self.client,
             "arrival": self.arrival, "prompt_tokens": self.prompt_tokens,
             "completion_tokens": self.completion_tokens,
             "cached_tokens": self.cached_tokens, "cost": self.cost,
             "finish_reasons": list(self.finish_reasons),
             "interventions": [i.to_dict() for i in self.interventions],
             "deadline_exceeded": self.deadline_exceeded, "shed": self.shed,
             "idempotent_replay": self.idempotent_replay, "cached": self.cached}
        if self.degraded:  # only then: most records have none
            d["degraded"] = list(self.degraded)
        if self.prompt is not None or self.outputs is not None:
            d["content"] = {"prompt": list(self.prompt or ()), "outputs": list(self.outputs or ())}
        return d


@dataclass(frozen=True)
class AdminRecord:
    """One call of the admin API with the admin key: who (the key's id, the client's address),
    what (method, path, body) and how it ended. A body over MAX_ADMIN_BODY bytes, or not JSON,
    is named by its sha256 only."""

    kind: ClassVar[str] = "admin"
    method: str
    route: str
    status: str  # as a request's: "ok", "shed", "404_not_found", ...
    status_code: int | None  # None: the client left
    key_id: str | None
    client: str | None
    body: Any = None  # the JSON body; None: none, or too large
    body_sha256: str | None = None  # of the body's bytes; None: no body

    def to_dict(self) -> dict:
        return {"method": self.method, "route": self.route, "status": self.status,
                "status_code": self.status_code, "key_id": self.key_id, "client": self.client,
                "body": self.body, "body_sha256": self.body_sha256}


@dataclass(frozen=True)
class StepRecord:
    """One step of an agent run (agents/run.py) as it starts and as it ends: which response and
    tenant, the step's id and kind (model_turn, tool_call), the tool, and its status (started,
    completed, failed, cancelled). No content: the step log holds that, and is deleted with the
    response."""

    kind: ClassVar[str] = "step"
    response_id: str
    step_id: str
    step_kind: str
    status: str
    tenant: str | None
    tool: str | None = None
    attempt: int = 1
    duration_s: float | None = None

    def to_dict(self) -> dict:
        return {"response_id": self.response_id, "step_id": self.step_id,
                "step_kind": self.step_kind, "status": self.status, "tenant": self.tenant,
                "tool": self.tool, "attempt": self.attempt, "duration_s": self.duration_s}


MAX_ADMIN_BODY = 4096


def admin_body(data: bytes) -> tuple[Any, str | None]:
    """(the body as an AdminRecord keeps it, its sha256) of a request body's bytes."""
    if not data:
        return None, None
    digest = hashlib.sha256(data).hexdigest()
    if len(data) > MAX_ADMIN_BODY:
        return None, digest
    try:
        return json.loads(data), digest
    except ValueError:
        return None, digest


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(ts: str) -> float:
    return datetime.fromisoformat(ts).timestamp()


def _digest(data: bytes, key: bytes | None) -> str:
    if key is None:
        return hashlib.sha256(data).hexdigest()
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def encode(body: dict, key: bytes | None = None) -> tuple[bytes, str]:
    """The line for `body` (without its newline) and its hash (its HMAC under `key`)."""
    head = json.dumps(body, separators=(",", ":")).encode()
    digest = _digest(head, key)
    name = b"hash" if key is None else b"hmac"
    return head[:-1] + b',"' + name + b'":"' + digest.encode() + b'"}', digest


def decode(line: bytes, key: bytes | None = None) -> tuple[dict, str]:
    """(the record, its hash); ValueError saying what is wrong with the line (KeyMismatch: it
    is keyed and `key` is None, or plain and `key` is given)."""
    m = _HASH_SUFFIX.search(line)
    if m is None:
        raise ValueError("not an audit record (no trailing hash)")
    keyed, digest = m.group(1) == b"hmac", m.group(2).decode()
    if keyed and key is None:
        raise KeyMismatch("keyed record (hmac): verify it with the log's key file")
    if not keyed and key is not None:
        raise KeyMismatch("not keyed: this log's key signs every record, this one has a plain "
                          "sha256 (rewritten without the key?)")
    if not hmac.compare_digest(_digest(line[:m.start()] + b"}", key), digest):
        raise ValueError("record changed: its content does not match its hash")
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record, digest


def read_key_file(path) -> bytes:
    """The HMAC key in `path` (its bytes, trailing whitespace removed); AuditError when it
    cannot be read or is shorter than MIN_KEY_BYTES."""
    try:
        key = Path(path).read_bytes().rstrip()
    except OSError as e:
        raise AuditError(f"cannot read the audit key file {path}: {e.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise AuditError(f"the audit key file {path} must hold at least {MIN_KEY_BYTES} bytes")
    return key


def data_file_name(number: int) -> str:
    return f"audit-{number:06d}.jsonl"


def checkpoint_file_name(number: int) -> str:
    return f"checkpoint-{number:06d}.jsonl"


def list_files(directory: Path) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]]]:
    """(data files, checkpoint files), each as (number, path) in number order."""
    data, checkpoints = [], []
    for p in directory.iterdir():
        if m := _DATA_FILE.match(p.name):
            data.append((int(m.group(1)), p))
        elif m := _CHECKPOINT_FILE.match(p.name):
            checkpoints.append((int(m.group(1)), p))
    return sorted(data), sorted(checkpoints)
