"""The audit log: one hash-chained JSON line per request (`AuditLog`), `verify` and `prune`.
Host-side: no JAX."""

from jaxserve.audit.log import AuditBacklogFull, AuditLog, AuditLogConfig, audit_log_config
from jaxserve.audit.record import AdminRecord, AuditError, AuditRecord, StepRecord
from jaxserve.audit.verify import PruneReport, VerifyReport, prune, verify

__all__ = ["AdminRecord", "AuditBacklogFull", "AuditError", "AuditLog", "AuditLogConfig", "AuditRecord",
           "PruneReport", "StepRecord", "VerifyReport", "audit_log_config", "prune", "verify"]
