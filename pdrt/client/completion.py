"""A finished request as the client hands it back, built from the `Tokens` frames the server sent."""

from dataclasses import dataclass, field

from pdrt.wire import Tokens, Usage


@dataclass(slots=True)
class Completion:
    """Everything one request produced.

    `finished` turns True with the last frame, whose `finish_reason` is
    "stop", "length" or "cancelled"; `stop_reason` names the stop string or stop token
    that ended it. `usage` comes with the last frame.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: list[float] | None = None
    finished: bool = False

    def add(self, delta: Tokens) -> None:
        """Append one streamed frame (or take the only frame of a non-streamed request)."""
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finished:
            self.finished = True
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.usage = delta.usage
