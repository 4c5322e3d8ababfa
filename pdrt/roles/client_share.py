"""How much of each gateway-wide limit one client may hold, so that no client shuts the others out alone.

A native connection, and a tenant of the HTTP front (a named API key,
pdrt/roles/tenants.py), holds at most half of the open requests, the open
drafts, the sessions and the warmup reservations; past its share it is
answered `overloaded`. The rest of the HTTP front (the unnamed key, or no
key) is not one client but many, under one identity: it is held to the
gateway's limits alone (what one of them may take is for the load balancer
in front of it, docs/deploy.md).
"""

from collections import Counter

from pdrt.http.server import HTTP_IDENTITY

CLIENT_SHARE = 0.5


def share_of(limit: int) -> int:
    """What one client may hold of `limit`."""
    return max(1, int(limit * CLIENT_SHARE))


def release(counts: Counter[bytes], identity: bytes) -> None:
    """`identity` holds one fewer of what `counts` counts; a client that holds none is no longer listed."""
    counts[identity] -= 1
    if not counts[identity]:
        del counts[identity]


def holds_a_share(identity: bytes) -> bool:
    """Whether `identity` is one client, held to its share (the HTTP front is many)."""
    return identity != HTTP_IDENTITY
