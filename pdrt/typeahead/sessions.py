"""What the gateway remembers of each chat session: the conversation so far, for warmups to prefill.

Bounded twice: at most `max_sessions` sessions (the least recently used
goes first) and at most `max_chars` characters per conversation (the oldest
turns go first, the system message stays).
"""

from collections import OrderedDict


class SessionStore:
    def __init__(self, max_sessions: int = 10_000, max_chars: int = 64_000) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self.sessions: OrderedDict[str, list[dict[str, str]]] = OrderedDict()

    def get(self, session_id: str) -> list[dict[str, str]] | None:
        messages = self.sessions.get(session_id)
        if messages is not None:
            self.sessions.move_to_end(session_id)
        return messages

    def record(self, session_id: str, messages: list[dict[str, str]], answer: str) -> None:
        """The conversation after a finished turn: the messages it was asked with, then its answer."""
        conversation = [*messages, {"role": "assistant", "content": answer}]
        first = 1 if conversation[0]["role"] == "system" else 0
        while len(conversation) > first + 1 and sum(len(m["content"]) for m in conversation) > self.max_chars:
            del conversation[first]
        self.sessions[session_id] = conversation
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
