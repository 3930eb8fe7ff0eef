"""The front door, host-side (no JAX): who asks (tenants, API keys), whether they may now
(limits), what their request is to the scheduler (QoS: class, share, deadlines), idempotent
replays, and what it costs. A transport calls `Gateway` in this order:

    principal = gateway.authenticate(authorization)            # 401
    gateway.check(principal, model)                            # 404, 429 before tokenizing
    admission = gateway.admit(principal, prompt_tokens, max_tokens, n, timeout_s)  # 400, 429
    ... engine.generate(..., qos=admission.qos) ...
    admission.settle(used_tokens)                              # on every terminal path
"""

from jaxserve.gateway.gateway import Admission, Gateway
from jaxserve.gateway.keys import Principal
from jaxserve.gateway.tenants import Tenant, Tenants, load_tenants, open_tenants

__all__ = ["Admission", "Gateway", "Principal", "Tenant", "Tenants", "load_tenants",
           "open_tenants"]
