"""One request seen from the asyncio client: its queue of replies, iterated as `Tokens` deltas.

The client's reader task fills the queue; this side takes from it, each wait
bounded by the timeout, and keeps the stream's state: whether the request was
sent, cancelled, resent after a gateway restart, or is over. See
async_client.py for the life of a request.
"""

import asyncio
import random
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
import structlog

from pdrt.client.completion import Completion
from pdrt.client.error_codes import error_from_reply
from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import ConnectionForgottenError, GatewayLostError, PdrtError, RequestTimeoutError
from pdrt.wire import Cancel, DraftSubmit, Error, Generate, Tokens

if TYPE_CHECKING:
    from pdrt.client.async_client import AsyncClient

log = structlog.get_logger(__name__)

Reply = Tokens | Error | PdrtError  # what a request's queue holds; a PdrtError is a local failure
MAX_RESUMES = 3


def seeded(params: SamplingParams | None) -> SamplingParams:
    """`params` with a seed of its own, so that a stream resumed on another gateway samples on as it would have."""
    params = params if params is not None else SamplingParams()
    return params if params.seed is not None else msgspec.structs.replace(params, seed=random.getrandbits(63))


class AsyncStream:
    """One request's output as `Tokens` deltas, ending after the finished frame.

    Iterate it with `async for`; an `Error` frame raises the typed error. Call
    `cancel()` to ask the server to stop: the stream then ends with a frame
    whose finish_reason is "cancelled". Leaving the loop early, `aclose()` or
    leaving `async with` cancels the request and forgets it. `completion`
    accumulates everything received so far.
    """

    def __init__(self, client: "AsyncClient", message: Generate | DraftSubmit, timeout_s: float,
                 fallback: Generate | None = None) -> None:
        """`fallback` is what a submitted draft stands for (a `Generate` of its final text): a gateway that was
        lost took the draft with it, and a new one is sent that instead."""
        self.client = client
        self.message = message
        self.fallback = fallback if isinstance(message, DraftSubmit) else message
        self.timeout_s = timeout_s
        self.completion = Completion(message.request_id)
        self._queue: asyncio.Queue[Reply] | None = None
        self._is_done = False  # the client no longer tracks this request
        self._is_cancel_sent = False
        self._is_resent = False
        self._num_replies = 0
        self._num_resumes = 0

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def is_done(self) -> bool:
        return self._is_done

    async def __anext__(self) -> Tokens:
        if self._is_done:
            raise StopAsyncIteration
        if self._queue is None:
            self._queue = await self.client._open(self.message)
        try:
            reply = await asyncio.wait_for(self._queue.get(), self.timeout_s)
        except TimeoutError:
            await self.aclose()
            raise RequestTimeoutError(f"no reply to request {self.request_id} for {self.timeout_s:g} s; "
                                      "it was cancelled") from None
        if isinstance(reply, Tokens):
            self._num_replies += 1
            self.completion.add(reply)
            if reply.finished:
                self._finish()
            return reply
        if isinstance(reply, ConnectionForgottenError) and self._may_resend():
            # The gateway never took this request (it restarted before): say Hello again and resend it.
            self._is_resent, self._queue, self.message = True, None, self.fallback
            return await self.__anext__()
        if isinstance(reply, ConnectionForgottenError) and self._may_resume():
            # The gateway was lost with the stream begun: the restarted one goes on from the tokens received.
            self._num_resumes += 1
            completion = self.completion
            self.message = msgspec.structs.replace(
                self.fallback, continuation=list(completion.token_ids),
                continuation_logprobs=list(completion.logprobs or ()) if self.fallback.params.logprobs else None)
            self._queue = None
            log.info("resuming a stream on a new gateway", request_id=self.request_id,
                     tokens=len(completion.token_ids))
            return await self.__anext__()
        self._finish()
        if isinstance(reply, ConnectionForgottenError):
            raise GatewayLostError(f"the gateway was lost with request {self.request_id} open, and the request "
                                   f"cannot go on on another ({self._why_not_resumed()})")
        raise reply if isinstance(reply, PdrtError) else error_from_reply(reply)

    def _may_resume(self) -> bool:
        # A non-streamed request has received nothing to go on from; an unseeded one would sample anew.
        return self.fallback is not None and self.fallback.stream and not self._is_cancel_sent \
            and self._num_resumes < MAX_RESUMES and self.fallback.params.seed is not None

    def _may_resend(self) -> bool:
        return not (self._num_replies or self._is_resent or self._is_cancel_sent) and self.fallback is not None

    def _why_not_resumed(self) -> str:
        if self._is_cancel_sent:
            return "it was being cancelled"
        if self.fallback is None:
            return "a submitted draft whose text is unknown"
        if not self.fallback.stream:
            return "not streamed"
        if self.fallback.params.seed is None:
            return "sampled without a seed"
        return f"resumed {self._num_resumes} times already"

    def __aiter__(self) -> AsyncIterator[Tokens]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Tokens]:
        # A generator, so that leaving `async for` early (break, an exception) finalizes it and cancels.
        try:
            while not self._is_done:
                yield await self.__anext__()
        finally:
            await self.aclose()

    async def cancel(self) -> None:
        """Ask the server to stop this request; iterating on gives the frames up to the "cancelled" one."""
        if self._is_done or self._is_cancel_sent:
            return
        if self._queue is None:  # never sent: end it here, as the server would have
            self.completion.add(Tokens(self.request_id, [], finished=True, finish_reason="cancelled"))
            self._is_done = True
            return
        self._is_cancel_sent = True
        self.client._send(Cancel(self.request_id))

    async def aclose(self) -> None:
        """Forget this request; if it was still running, cancel it on the server (its last frames are dropped)."""
        if self._is_done:
            return
        self._finish()
        if self._queue is not None:
            try:
                self.client._send(Cancel(self.request_id))
            except PdrtError as exc:  # the client is closed or its queue is full: the server's deadline ends it
                log.info("could not cancel a request", request_id=self.request_id, error=str(exc))

    def _finish(self) -> None:
        self._is_done = True
        self.client._requests.pop(self.request_id, None)

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
