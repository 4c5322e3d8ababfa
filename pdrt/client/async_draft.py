"""A prompt the user is still typing, seen from the asyncio client (docs/protocol.md, "Streaming input").

Send the text as it changes — `append`, `replace` for edits and backspace,
or `set_text` with the whole input box — and the server prefills the part of
it that can no longer change. `submit` turns it into a request whose output
equals that of sending the final text at once; `abandon` drops it. The
server answers these messages only when something is wrong: such an error
is raised by the draft's next call.
"""

import asyncio
import uuid
from typing import TYPE_CHECKING

import msgspec

from pdrt.client.async_stream import AsyncStream, Reply, seeded
from pdrt.client.error_codes import error_from_reply
from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import InvalidRequestError, PdrtError
from pdrt.wire import ChatMessage, DraftAbandon, DraftAppend, DraftOpen, DraftReplace, DraftSubmit, Error, Generate

if TYPE_CHECKING:
    from pdrt.client.async_client import AsyncClient


class AsyncDraft:
    def __init__(self, client: "AsyncClient", messages: list[ChatMessage] | None, session_id: str,
                 cache_salt: str = "") -> None:
        self.client = client
        self.draft_id = uuid.uuid4().hex
        self.text = ""
        self._open_message = DraftOpen(self.draft_id, messages, session_id, cache_salt)
        self._errors: asyncio.Queue[Reply] | None = None
        self._is_over = False

    async def _ensure_open(self) -> None:
        if self._is_over:
            raise InvalidRequestError(f"draft {self.draft_id} was already submitted or abandoned")
        if self._errors is None:
            self._errors = await self.client._open(self._open_message, self.draft_id)
        self._raise_pending()

    def _raise_pending(self) -> None:
        assert self._errors is not None
        if not self._errors.empty():
            reply = self._errors.get_nowait()
            self._end()
            raise reply if isinstance(reply, PdrtError) else error_from_reply(reply) if isinstance(reply, Error) \
                else InvalidRequestError(f"unexpected reply to a draft: {reply!r}")

    async def append(self, text: str) -> None:
        await self._ensure_open()
        if text:
            self.client._send(DraftAppend(self.draft_id, text))
            self.text += text

    async def replace(self, num_kept_chars: int, text: str = "") -> None:
        """Keep the first `num_kept_chars` characters, then `text` (backspace: keep fewer, add nothing)."""
        await self._ensure_open()
        if not (0 <= num_kept_chars <= len(self.text)):
            raise InvalidRequestError(f"the draft has {len(self.text)} characters; cannot keep {num_kept_chars}")
        self.client._send(DraftReplace(self.draft_id, num_kept_chars, text))
        self.text = self.text[:num_kept_chars] + text

    async def set_text(self, text: str) -> None:
        """The input box now reads `text`: send the smallest change that gets there."""
        kept = 0
        for a, b in zip(self.text, text, strict=False):
            if a != b:
                break
            kept += 1
        if kept == len(self.text):
            await self.append(text[kept:])
        else:
            await self.replace(kept, text[kept:])

    async def submit(self, params: SamplingParams | None = None, stream: bool = True,
                     timeout_s: float | None = None) -> AsyncStream:
        """The user pressed Enter: the request's output, as a stream (iterate it; a non-streamed one yields once)."""
        await self._ensure_open()
        self._end()
        opened = self._open_message
        params = msgspec.structs.replace(seeded(params), cache_salt=opened.cache_salt)  # the server's choice too
        message = DraftSubmit(self.draft_id, uuid.uuid4().hex, params, stream, timeout_s)
        # What the submit stands for, should the gateway be lost with the draft: a generate of the final text.
        fallback = Generate(message.request_id, prompt=self.text if opened.messages is None else None,
                            messages=None if opened.messages is None else
                            [*opened.messages, ChatMessage("user", self.text)],
                            params=message.params, stream=stream, timeout_s=timeout_s, session_id=opened.session_id)
        return AsyncStream(self.client, message, self.client.timeout_s if timeout_s is None else timeout_s, fallback)

    async def abandon(self) -> None:
        if self._errors is not None and not self._is_over:
            self.client._send(DraftAbandon(self.draft_id))
        self._end()

    def _end(self) -> None:
        self._is_over = True
        self.client._requests.pop(self.draft_id, None)
