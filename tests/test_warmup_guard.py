"""The warmup guard: only authentic, fresh, first-seen, rate-limited datagrams get through; memory stays bounded."""

import os

import msgspec

from pdrt.warmup.datagram import sign
from pdrt.warmup.guard import WarmupGuard

KEY = b"k" * 32
NOW = 1_000_000.0


def guard(**kwargs) -> WarmupGuard:
    return WarmupGuard(KEY, "m", **kwargs)


def test_an_authentic_fresh_datagram_is_accepted_once_and_its_replay_dropped():
    g = guard()
    datagram = sign(KEY, "s1", "m", timestamp=NOW)
    assert g.check(datagram, "1.2.3.4", now=NOW + 0.5) == "s1"
    assert g.check(datagram, "1.2.3.4", now=NOW + 1.0) is None
    assert g.dropped["replayed"] == 1 and g.accepted == 1


def test_forged_stale_malformed_and_foreign_datagrams_are_dropped_by_reason():
    g = guard()
    forged = sign(b"x" * 32, "s1", "m", timestamp=NOW)
    stale = sign(KEY, "s1", "m", timestamp=NOW - 60)
    future = sign(KEY, "s1", "m", timestamp=NOW + 60)
    other_model = sign(KEY, "s1", "other", timestamp=NOW)
    tampered = bytearray(sign(KEY, "s1", "m", timestamp=NOW))
    tampered[3] ^= 1  # a byte of the session id
    cases = [forged, stale, future, other_model, bytes(tampered), b"", os.urandom(40), b"\xff" * 4000,
             msgspec.msgpack.encode(["s", "m", NOW, b"short", b"mac"])]
    for data in cases:
        assert g.check(data, "1.2.3.4", now=NOW) is None
    assert g.accepted == 0
    assert g.dropped["unauthenticated"] == 2 and g.dropped["stale"] == 2 and g.dropped["wrong_model"] == 1
    assert g.dropped["malformed"] == 4


def test_rate_limits_per_source_and_per_session():
    g = guard(per_source_rate=5, per_session_rate=100)
    accepted = [g.check(sign(KEY, f"s{i}", "m", timestamp=NOW), "9.9.9.9", now=NOW) for i in range(20)]
    assert sum(a is not None for a in accepted) == 5 and g.dropped["rate_limited_source"] == 15
    assert g.check(sign(KEY, "t", "m", timestamp=NOW), "8.8.8.8", now=NOW) == "t"  # another source is fine
    g = guard(per_source_rate=1000, per_session_rate=1)
    accepted = [g.check(sign(KEY, "same", "m", timestamp=NOW), f"10.0.0.{i}", now=NOW) for i in range(10)]
    assert sum(a is not None for a in accepted) == 2 and g.dropped["rate_limited_session"] == 8


def test_a_flood_of_100k_forged_and_replayed_datagrams_changes_nothing_and_stays_bounded():
    g = guard(max_nonces=1000, max_sources=64)
    valid = sign(KEY, "s", "m", timestamp=NOW)
    assert g.check(valid, "src", now=NOW) == "s"
    for i in range(100_000):
        data = valid if i % 2 else sign(b"wrong", f"s{i}", "m", timestamp=NOW)
        assert g.check(data, f"10.{i % 250}.{i // 250 % 250}.1", now=NOW + i * 1e-5) is None
    assert g.accepted == 1
    assert len(g.nonces) <= 1000 and len(g.sources.buckets) <= 64 and len(g.sessions.buckets) <= 64
    assert g.dropped["unauthenticated"] == 50_000 and g.dropped["replayed"] == 50_000
