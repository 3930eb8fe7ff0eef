"""The audit log: one hash-chained JSON line per request (`AuditLog`), `verify` and `prune`.
Host-side: no JAX."""

from jaxserve.audit.log import AuditBacklogFull, AuditLog, AuditLogConfig
from jaxserve.audit.record import AuditError, AuditRecord
from jaxserve.audit.verify import PruneReport, VerifyReport, prune, verify

__all__ = ["AuditBacklogFull", "AuditError", "AuditLog", "AuditLogConfig", "AuditRecord",
           "PruneReport", "VerifyReport", "prune", "verify"]
