"""Tenants: the named API keys of the HTTP front, and the cache salt that keeps prefix caches apart.

Each key of `[gateway] api_keys` names a tenant. A tenant's HTTP requests
reach the gateway under an identity of their own (`http_identity`), so that
a tenant is held to its share of the gateway's limits as one native
connection is (pdrt/roles/client_share.py), and its drafts and sessions are
its own. The unnamed `[gateway] api_key` (or none) is the HTTP front as one.

A request's prompt KV is shared only with requests of an equal salt: the
gateway replaces the salt a client gives (`SamplingParams.cache_salt`) by
`worker_salt`, a digest of the tenant's name and that salt, so no client can
name a salt that reaches another tenant's cache. Without a tenant and a
salt, requests share one cache, as they always have.
"""

import hashlib

from pdrt.http.server import HTTP_IDENTITY

_SEPARATOR = b"/"


def http_identity(tenant: str) -> bytes:
    """The client identity of the HTTP requests made with `tenant`'s key ("": the unnamed key)."""
    return HTTP_IDENTITY + _SEPARATOR + tenant.encode() if tenant else HTTP_IDENTITY


def is_http(identity: bytes) -> bool:
    return identity == HTTP_IDENTITY or identity.startswith(HTTP_IDENTITY + _SEPARATOR)


def tenant_of(identity: bytes) -> str:
    """The tenant whose key made the requests of `identity`; "" for native clients and the unnamed key."""
    prefix = HTTP_IDENTITY + _SEPARATOR
    return identity[len(prefix):].decode() if identity.startswith(prefix) else ""


def worker_salt(identity: bytes, cache_salt: str) -> str:
    """The salt the workers key `identity`'s request by, given the salt its client asked for."""
    tenant = tenant_of(identity)
    if not tenant and not cache_salt:
        return ""
    return hashlib.blake2b(f"{len(tenant)}:{tenant}:{cache_salt}".encode(), digest_size=16).hexdigest()
