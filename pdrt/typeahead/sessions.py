"""What the gateway remembers of each chat session: the conversation so far, for warmups to prefill.

A session belongs to the client that made it (its connection, or an HTTP
tenant): a session id is looked up among its owner's sessions, so that no
client reads, overwrites or warms another's. Bounded three ways: at most
`max_sessions` sessions, of which one owner holds at most `max_per_owner`
(the HTTP front aside: pdrt/roles/client_share.py; the owner's least
recently used goes first; when the store is full, the least recently used
session of the owner holding the most goes), and at most `max_chars`
characters per conversation (the oldest turns go first, the system message
stays).
"""

from collections import Counter, OrderedDict

from pdrt.roles.client_share import holds_a_share, release

SessionKey = tuple[bytes, str]  # (owner, session id)


class SessionStore:
    def __init__(self, max_sessions: int = 10_000, max_per_owner: int = 5_000, max_chars: int = 64_000) -> None:
        self.max_sessions = max_sessions
        self.max_per_owner = max_per_owner
        self.max_chars = max_chars
        # (owner, id) -> the conversation, and the cache salt of its requests (a warmup prefills under it)
        self.sessions: OrderedDict[SessionKey, tuple[list[dict[str, str]], str]] = OrderedDict()
        self.num_by_owner: Counter[bytes] = Counter()
        self.last_owner: dict[str, bytes] = {}  # session id -> who recorded it last (for UDP warmups)

    def get(self, key: SessionKey) -> list[dict[str, str]] | None:
        session = self.sessions.get(key)
        if session is None:
            return None
        self.sessions.move_to_end(key)
        return session[0]

    def salt_of(self, key: SessionKey) -> str:
        """The cache salt (the workers') of the session's last request."""
        session = self.sessions.get(key)
        return "" if session is None else session[1]

    def key_of(self, session_id: str) -> SessionKey | None:
        """The session `session_id` names for a holder of the warmup key, who may warm any owner's."""
        owner = self.last_owner.get(session_id)
        return None if owner is None else (owner, session_id)

    def record(self, key: SessionKey, messages: list[dict[str, str]], answer: str, cache_salt: str = "") -> None:
        """The conversation after a finished turn: the messages it was asked with, then its answer."""
        conversation = [*messages, {"role": "assistant", "content": answer}]
        first = 1 if conversation[0]["role"] == "system" else 0
        while len(conversation) > first + 1 and sum(len(m["content"]) for m in conversation) > self.max_chars:
            del conversation[first]
        owner = key[0]
        if key not in self.sessions:
            self.num_by_owner[owner] += 1
        self.sessions[key] = (conversation, cache_salt)
        self.sessions.move_to_end(key)
        self.last_owner[key[1]] = owner
        if self.num_by_owner[owner] > self.max_per_owner and holds_a_share(owner):
            self._evict(owner)
        while len(self.sessions) > self.max_sessions:
            self._evict(self.num_by_owner.most_common(1)[0][0])

    def _evict(self, owner: bytes) -> None:
        """Forget `owner`'s least recently used session."""
        key = next(k for k in self.sessions if k[0] == owner)
        del self.sessions[key]
        release(self.num_by_owner, owner)
        if self.last_owner.get(key[1]) == owner:
            del self.last_owner[key[1]]
