"""API keys: `Authorization: Bearer KEY` (gRPC: metadata `authorization`) -> the tenant.

The presented key is hashed (sha256) and its digest looked up in the tenants' digests: the time a
lookup takes does not depend on how much of a real key an attacker guessed (what a comparison
of plaintext keys, character by character, would leak), since a guess's digest shares nothing
predictable with a real one; the match is confirmed with `hmac.compare_digest`. The key itself
goes nowhere: logs and audit records carry the key id, a short hash.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from jaxserve.errors import Unauthenticated
from jaxserve.gateway.tenants import Tenant, Tenants, hash_key


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant, and which of its keys (None on an open server)."""

    tenant: Tenant
    key_id: str | None = None


def key_id(digest: bytes) -> str:
    """A key's id for logs: the first 12 hex digits of its sha256 (the file may hold only the
    digest, so the id cannot need the key)."""
    return digest.hex()[:12]


def presented_key_id(authorization: str | None) -> str | None:
    """The key id of whatever key a refused caller sent (for its audit record: repeated bad
    keys show as one id, and the key itself is never written); None when it sent none."""
    try:
        return key_id(hash_key(bearer_token(authorization)))
    except Unauthenticated:
        return None


def bearer_token(authorization: str | None) -> str:
    """The key in an `Authorization: Bearer KEY` value."""
    if not authorization:
        raise Unauthenticated("You didn't provide an API key. Send it as "
                              "'Authorization: Bearer KEY'.")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("The Authorization header must be 'Bearer KEY'.")
    return token


def authenticate(tenants: Tenants, authorization: str | None) -> Principal:
    """The caller's tenant, or Unauthenticated (401). An open server (no tenants file) admits
    everyone as `default`, whatever they send, as OpenAI clients always send some key."""
    if tenants.open:
        return Principal(tenants.get("default"))
    digest = hash_key(bearer_token(authorization))
    name = tenants.by_digest.get(digest)
    if name is None:
        raise Unauthenticated("Incorrect API key provided.")
    stored = tenants.tenants[name].key_digests
    if not any(hmac.compare_digest(digest, d) for d in stored):  # what the lookup found
        raise Unauthenticated("Incorrect API key provided.")
    return Principal(tenants.tenants[name], key_id(digest))
