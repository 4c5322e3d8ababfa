"""Which warmup datagrams may act: authenticated, fresh, first seen, and within the rate limits.

Everything here is bounded whatever arrives: the replay cache holds only
nonces young enough to still be fresh and has a hard size cap, the rate
limiters keep a bounded LRU of buckets. A datagram is checked in order of
cost and of trust: shape, model, MAC (forgeries stop here, before they can
touch any state), age, replay, then the per-source and per-session rates.
Each drop is counted by reason.
"""

import time
from collections import Counter, OrderedDict

from pdrt.warmup.datagram import WarmupDatagram, decode, is_authentic

DROP_REASONS = ("malformed", "wrong_model", "unauthenticated", "stale", "replayed", "rate_limited_source",
                "rate_limited_session")


class TokenBuckets:
    """A token bucket per key (refilling `rate` per second up to `burst`), for at most `max_keys` keys."""

    def __init__(self, rate: float, burst: float, max_keys: int) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.buckets: OrderedDict[object, tuple[float, float]] = OrderedDict()

    def take(self, key: object, now: float) -> bool:
        tokens, last = self.buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self.buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self.buckets) > self.max_keys:
            self.buckets.popitem(last=False)
        return allowed


class WarmupGuard:
    def __init__(self, key: bytes, model: str, max_age_s: float = 5.0, per_source_rate: float = 20.0,
                 per_session_rate: float = 2.0, max_nonces: int = 100_000, max_sources: int = 4096) -> None:
        self.key = key
        self.model = model
        self.max_age_s = max_age_s
        self.nonces: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it stops being fresh
        self.max_nonces = max_nonces
        self.sources = TokenBuckets(per_source_rate, per_source_rate, max_sources)
        self.sessions = TokenBuckets(per_session_rate, per_session_rate * 2, max_sources)
        self.dropped: Counter[str] = Counter()
        self.accepted = 0

    def check(self, data: bytes, source: object, now: float | None = None) -> str | None:
        """The session id to warm up, or None (the drop is counted)."""
        now = time.time() if now is None else now
        datagram = decode(data)
        reason = self._reject(datagram, source, now)
        if reason is not None:
            self.dropped[reason] += 1
            return None
        assert datagram is not None
        self.accepted += 1
        return datagram.session_id

    def _reject(self, datagram: WarmupDatagram | None, source: object, now: float) -> str | None:
        if datagram is None:
            return "malformed"
        if datagram.model != self.model:
            return "wrong_model"
        if not is_authentic(self.key, datagram):
            return "unauthenticated"
        if not (now - self.max_age_s <= datagram.timestamp <= now + 1.0):  # 1 s of clock skew ahead
            return "stale"
        self._forget_old_nonces(now)
        if datagram.nonce in self.nonces:
            return "replayed"
        if not self.sources.take(source, now):
            return "rate_limited_source"
        if not self.sessions.take(datagram.session_id, now):
            return "rate_limited_session"
        self.nonces[datagram.nonce] = datagram.timestamp + self.max_age_s
        while len(self.nonces) > self.max_nonces:
            # Full of fresh nonces: only authentic datagrams get here, within the
            # source rate limit, so this takes a key holder flooding from many
            # addresses; forgetting the oldest keeps memory bounded.
            self.nonces.popitem(last=False)
        return None

    def _forget_old_nonces(self, now: float) -> None:
        while self.nonces:
            nonce, expires = next(iter(self.nonces.items()))
            if expires > now:
                break
            del self.nonces[nonce]
