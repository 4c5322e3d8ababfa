"""The blocking client: the asyncio client run on an event loop of its own, in a background thread.

One implementation of the protocol serves both: every `Client` method hands
the matching `AsyncClient` coroutine to the loop thread and waits for it. An
interrupt while waiting (Ctrl-C) cancels that coroutine too, and a stream
abandoned that way is cancelled on the server when its iterator is closed.
"""

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from pdrt.client.async_client import DEFAULT_TIMEOUT_S, AsyncClient, Messages
from pdrt.client.async_draft import AsyncDraft
from pdrt.client.async_stream import AsyncStream
from pdrt.client.completion import Completion
from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import ClientClosedError
from pdrt.wire import Ready, Status, Tokens

T = TypeVar("T")


class Stream:
    """One streamed request: iterate for `Tokens` deltas; `cancel()` asks the server to stop.

    Leaving the loop early, `close()`, or leaving `with` cancels the request
    and forgets it. `completion` accumulates everything received so far.
    """

    def __init__(self, client: "Client", stream: AsyncStream) -> None:
        self._client = client
        self._stream = stream

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def completion(self) -> Completion:
        return self._stream.completion

    def __iter__(self) -> Iterator[Tokens]:
        try:
            while not self._stream.is_done:
                yield self._client._call(self._stream.__anext__())
        except StopAsyncIteration:
            return
        finally:
            self.close()

    def cancel(self) -> None:
        self._client._call(self._stream.cancel())

    def close(self) -> None:
        if not self._stream.is_done and not self._client.is_closed:
            self._client._call(self._stream.aclose())

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Draft:
    """A prompt the user is typing (see `AsyncDraft`): `append`, `replace`, `set_text`, then `submit` or `abandon`."""

    def __init__(self, client: "Client", draft: AsyncDraft) -> None:
        self._client = client
        self._draft = draft

    @property
    def text(self) -> str:
        return self._draft.text

    def append(self, text: str) -> None:
        self._client._call(self._draft.append(text))

    def replace(self, num_kept_chars: int, text: str = "") -> None:
        self._client._call(self._draft.replace(num_kept_chars, text))

    def set_text(self, text: str) -> None:
        self._client._call(self._draft.set_text(text))

    def submit(self, params: SamplingParams | None = None, stream: bool = True,
               timeout_s: float | None = None) -> Stream:
        return Stream(self._client, self._client._call(self._draft.submit(params, stream, timeout_s)))

    def abandon(self) -> None:
        self._client._call(self._draft.abandon())


class Client:
    """A blocking connection to one gateway; see `AsyncClient` for what each method does and its timeouts."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "pdrt-python") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdrt-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(address, timeout_s, name)

    @property
    def address(self) -> str:
        return self._async.address

    @property
    def ready(self) -> Ready | None:
        return self._async.ready

    @property
    def is_closed(self) -> bool:
        return self._loop.is_closed()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise ClientClosedError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupt while waiting: stop the coroutine as well (no-op when it is done)
            raise

    def connect(self, timeout_s: float | None = None) -> Ready:
        return self._call(self._async.connect(timeout_s))

    def generate(self, prompt: str | None = None, messages: Messages | None = None,
                 token_ids: list[int] | None = None, params: SamplingParams | None = None,
                 timeout_s: float | None = None, session_id: str = "") -> Completion:
        return self._call(self._async.generate(prompt, messages, token_ids, params, timeout_s, session_id))

    def stream(self, prompt: str | None = None, messages: Messages | None = None,
               token_ids: list[int] | None = None, params: SamplingParams | None = None,
               timeout_s: float | None = None, session_id: str = "") -> Stream:
        return Stream(self, self._async.stream(prompt, messages, token_ids, params, timeout_s, session_id))

    def draft(self, messages: Messages | None = None, session_id: str = "", cache_salt: str = "") -> Draft:
        return Draft(self, self._async.draft(messages, session_id, cache_salt))

    def warmup(self, session_id: str) -> None:
        self._call(self._async.warmup(session_id))

    def status(self, timeout_s: float | None = None) -> Status:
        return self._call(self._async.status(timeout_s))

    def wait_ready(self, expected_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Status:
        return self._call(self._async.wait_ready(expected_workers, timeout_s))

    def close(self) -> None:
        """Close the connection (cancelling open requests on the server) and stop the loop thread."""
        if self.is_closed:
            return
        try:
            self._call(self._async.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> "Client":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
