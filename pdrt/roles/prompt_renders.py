"""Prompts too large to tokenize on the gateway's event loop: rendered on a thread of their own, then admitted.

A prompt of up to `INLINE_CHARS` characters is tokenized in place, in
milliseconds. A larger one (a pasted document, or an attack) would hold the
loop for up to a few tenths of a second (`PromptRenderer.max_chars` bounds
it), delaying heartbeats and every other client's tokens; it goes to one
render thread instead, with a tokenizer of its own (a fast tokenizer is not
safe to use from two threads at once), and comes back to the gateway actor
as a `Rendered` message. While it renders, the request is open: its id is
taken, it counts against the open-request limit, a `Cancel` ends it at once,
and a client that leaves drops it.
"""

import asyncio
import copy
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from pdrt.errors import OverloadedError, PdrtError
from pdrt.roles.prompt_renderer import PromptRenderer

log = structlog.get_logger(__name__)

INLINE_CHARS = 8192
MAX_PENDING = 8  # renders waiting or running; each holds its request's text (a frame: at most 8 MiB)


@dataclass(slots=True)
class Rendered:
    """To the gateway actor: a render ended, with the prompt's ids or the error that ends the request."""

    identity: bytes
    request_id: str
    result: list[int] | PdrtError
    then: Callable[[list[int]], None]


class PromptRenders:
    def __init__(self, renderer: PromptRenderer, deliver: Callable[[Rendered], Awaitable[None]]) -> None:
        self.renderer = PromptRenderer(copy.deepcopy(renderer.tokenizer), renderer.max_model_len,
                                       renderer.vocab_size)  # the render thread's own
        self.deliver = deliver
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="prompt-render")
        self.pending: dict[tuple[bytes, str], bool] = {}  # (client, request id) -> cancelled
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, key: tuple[bytes, str]) -> bool:
        return key in self.pending

    def start(self, identity: bytes, request_id: str, render: Callable[[PromptRenderer], list[int]],
              then: Callable[[list[int]], None]) -> None:
        """Run `render(renderer)` on the render thread; `then(ids)` runs on the actor when it is done."""
        if len(self.pending) >= MAX_PENDING:
            raise OverloadedError(f"{MAX_PENDING} large prompts are being tokenized; retry later")
        self.pending[(identity, request_id)] = False
        task = asyncio.get_running_loop().create_task(self._render(identity, request_id, render, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _render(self, identity: bytes, request_id: str, render: Callable[[PromptRenderer], list[int]],
                      then: Callable[[list[int]], None]) -> None:
        result: list[int] | PdrtError
        try:
            result = await asyncio.get_running_loop().run_in_executor(self.executor, render, self.renderer)
        except PdrtError as exc:
            result = exc
        except Exception as exc:  # the tokenizer's own failure ends this request, nothing else
            log.exception("a prompt could not be rendered", request_id=request_id)
            result = PdrtError(f"the prompt could not be tokenized: {exc!r}")
        await self.deliver(Rendered(identity, request_id, result, then))

    def finish(self, rendered: Rendered) -> bool:
        """Whether the request still wants its render (not cancelled, its client not gone)."""
        return self.pending.pop((rendered.identity, rendered.request_id), True) is False

    def cancel(self, identity: bytes, request_id: str) -> bool:
        """Cancel a render in flight; False when there is none."""
        if (identity, request_id) not in self.pending:
            return False
        self.pending[(identity, request_id)] = True
        return True

    def forget_client(self, identity: bytes) -> None:
        for key in [k for k in self.pending if k[0] == identity]:
            self.pending[key] = True

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
