"""The HTTP front of the gateway (aiohttp, on the gateway's own event loop), and the routes it serves.

Every request over HTTP takes the same path as one over the native
protocol: the handler turns it into the same client message and asks the
gateway actor to take it, under one reserved client identity; the gateway's
replies for that identity come back here (`deliver`) and are sorted by
request id into per-request queues. A handler whose client disconnects is
cancelled (aiohttp's handler cancellation) and cancels its request, so its
KV is freed.

Routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models` (OpenAI);
`/v1/pdrt/drafts...` and `/v1/pdrt/warmup` (type-ahead and warmup for
browsers); `/health`, `/metrics`; `/` and `/static/*` (the demo page).
With an API key configured, every `/v1/` route needs `Authorization: Bearer`.
"""

import asyncio
import hmac
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from pdrt.errors import ConfigError, PdrtError
from pdrt.http.openai_api import (
    Body,
    ChatBody,
    CompletionBody,
    DraftOpenBody,
    DraftSubmitBody,
    DraftTextBody,
    Response,
    WarmupBody,
    decode_body,
    error_body,
    error_of,
)
from pdrt.metrics.gateway_view import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdrt.wire import Cancel, DraftAbandon, DraftOpen, DraftSubmit, Error, Generate, Status, Tokens, Warmup

log = structlog.get_logger(__name__)

HTTP_IDENTITY = b"\x00http"  # the client identity of HTTP requests made with no key or the unnamed one
STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 8 << 20
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class DraftText:
    """HTTP's way to edit a draft: the input box now reads `text`; the gateway works out the change."""

    draft_id: str
    text: str


class HttpFront:
    def __init__(self, host: str, port: int, tenants: dict[str, str], model: str, context_length: int,
                 request_timeout_s: float, ask: Callable[[object, str], Awaitable[PdrtError | None]],
                 tell: Callable[[object, str], None], status: Callable[[], Status],
                 metrics: Callable[[], bytes]) -> None:
        """`tenants` maps each API key to its tenant's name ("" for the unnamed key); empty: no key is needed.
        `ask` and `tell` take a client message and the tenant that sent it."""
        self.host, self.port = host, port
        self.keys = [(f"Bearer {key}".encode(), tenant) for key, tenant in tenants.items()]
        self.model = model
        self.context_length = context_length
        self.wait_s = request_timeout_s + 30.0  # the gateway ends every request by its deadline; this is a backstop
        self.ask, self.tell = ask, tell
        self.status, self.metrics = status, metrics
        self.queues: dict[str, asyncio.Queue[Tokens | Error]] = {}
        self.runner: web.AppRunner | None = None
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.post("/v1/pdrt/drafts", self.open_draft),
            web.put("/v1/pdrt/drafts/{draft_id}", self.draft_text),
            web.post("/v1/pdrt/drafts/{draft_id}/submit", self.submit_draft),
            web.delete("/v1/pdrt/drafts/{draft_id}", self.abandon_draft),
            web.post("/v1/pdrt/warmup", self.warmup),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            web.get("/", self.index),
        ])
        if STATIC_DIR.is_dir():
            app.router.add_static("/static/", STATIC_DIR)
        self.app = app

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            raise ConfigError(f"cannot listen on http://{self.host}:{self.port}: {exc.strerror or exc}") from exc
        log.info("http serving", address=f"http://{self.host}:{self.port}")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def deliver(self, message: msgspec.Struct) -> None:
        """A reply of the gateway to the HTTP identity: to the queue of the request it belongs to."""
        request_id = getattr(message, "request_id", None)
        queue = self.queues.get(request_id) if request_id is not None else None
        if queue is not None:
            queue.put_nowait(message)

    # -- middleware ---------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except PdrtError as exc:
            status, body = error_of(exc)
            return web.json_response(body, status=status)
        except TimeoutError:  # a backstop wait gave up; the gateway's own deadline should have come first
            status, body = error_body("timeout", "no answer from the gateway in time")
            return web.json_response(body, status=status)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """Find the tenant of the request's API key (every key compared, in constant time each)."""
        tenant: str | None = ""
        if self.keys and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            tenant = None
            for key, name in self.keys:
                if hmac.compare_digest(given, key):
                    tenant = name
            if tenant is None:
                status, body = error_body("unauthorized", "a valid API key is required: Authorization: Bearer KEY")
                return web.json_response(body, status=status)
        request["tenant"] = tenant
        return await handler(request)

    async def _body(self, request: web.Request, kind: type[Body]) -> Body:
        """The request's body as `kind`; InvalidRequestError (a 400) saying what is wrong and where."""
        return decode_body(await request.read(), kind)

    async def _take(self, request: web.Request, message: object) -> None:
        """Hand a client message to the gateway; its refusal is raised here (and becomes the HTTP error)."""
        error = await self.ask(message, request["tenant"])
        if error is not None:
            raise error

    # -- OpenAI -------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, ChatBody)
        return await self._generate(request, body.generate(self.context_length), True, body.include_usage)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, CompletionBody)
        return await self._generate(request, body.generate(), False, body.include_usage)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "pdrt",
             "max_model_len": self.context_length}]})

    async def _generate(self, request: web.Request, message: Generate | DraftSubmit, chat: bool,
                        usage: bool) -> web.StreamResponse:
        queue: asyncio.Queue[Tokens | Error] = asyncio.Queue()
        self.queues[message.request_id] = queue
        ended = False
        ids = {"X-Request-Id": message.request_id}  # the gateway logs it as client_request_id
        try:
            await self._take(request, message)
            response = Response(chat, self.model)
            if message.stream:
                try:
                    out = await self._stream(request, queue, response, usage, ids)
                except _HttpError as exc:  # the request failed before its first token: a plain error response
                    ended = True
                    return web.json_response(exc.body, status=exc.status, headers=ids)
                ended = True
                return out
            async with asyncio.timeout(self.wait_s):
                while True:
                    frame = await queue.get()
                    if isinstance(frame, Error):
                        ended = True
                        status, body = error_body(frame.code, frame.message)
                        return web.json_response(body, status=status, headers=ids)
                    response.add(frame)
                    if frame.finished:
                        ended = True
                        return web.json_response(response.body(), headers=ids)
        finally:
            self.queues.pop(message.request_id, None)
            if not ended:  # the client went away (or the wait gave up): free the request's KV
                self.tell(Cancel(message.request_id), request["tenant"])

    async def _stream(self, request: web.Request, queue: asyncio.Queue[Tokens | Error], response: Response,
                      usage: bool, headers: dict[str, str]) -> web.StreamResponse:
        """Send server-sent events until the request ends (finished, or failed after its first token).

        One deadline covers the whole request, as the gateway's own does (on
        Python 3.11 a `wait_for` per frame makes a Task per token), and the
        frames that queued while this handler waited for the loop go out in
        one write.
        """
        async with asyncio.timeout(self.wait_s):
            frame = await queue.get()  # an early error still gets its status code
            if isinstance(frame, Error):
                status, body = error_body(frame.code, frame.message)
                raise _HttpError(status, body)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                              **headers})
            await out.prepare(request)
            first = response.first_chunk()
            events = [] if first is None else [_event(first)]
            while True:
                if isinstance(frame, Error):
                    events += [_event(error_body(frame.code, frame.message)[1]), DONE]
                    break
                response.add(frame)
                chunk = response.chunk(frame)
                if chunk is not None:
                    events.append(_event(chunk))
                if frame.finished:
                    if usage:
                        events.append(_event(response.usage_chunk()))
                    events.append(DONE)
                    break
                if queue.empty():
                    if events:
                        await out.write(b"".join(events))
                        events = []
                    frame = await queue.get()
                else:
                    frame = queue.get_nowait()
            await out.write(b"".join(events))
            await out.write_eof()
            return out

    # -- type-ahead and warmup ------------------------------------------------------------

    async def open_draft(self, request: web.Request) -> web.Response:
        body = await self._body(request, DraftOpenBody)
        draft_id = uuid.uuid4().hex
        await self._take(request, DraftOpen(draft_id, body.chat_messages(), body.session_id or "",
                                            body.cache_salt or ""))
        return web.json_response({"draft_id": draft_id}, status=201)

    async def draft_text(self, request: web.Request) -> web.Response:
        body = await self._body(request, DraftTextBody)
        await self._take(request, DraftText(request.match_info["draft_id"], body.text))
        return web.Response(status=204)

    async def submit_draft(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, DraftSubmitBody)
        message = DraftSubmit(request.match_info["draft_id"], uuid.uuid4().hex,
                              body.sampling_params(self.context_length), bool(body.stream))
        return await self._generate(request, message, True, body.include_usage)

    async def abandon_draft(self, request: web.Request) -> web.Response:
        await self._take(request, DraftAbandon(request.match_info["draft_id"]))
        return web.Response(status=204)

    async def warmup(self, request: web.Request) -> web.Response:
        body = await self._body(request, WarmupBody)
        self.tell(Warmup(body.session_id), request["tenant"])
        return web.Response(status=204)

    # -- operations --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        status = self.status()
        workers = [{"process": w.process_id, "role": w.role, "alive": w.alive} for w in status.workers]
        ok = any(w.alive for w in status.workers)
        return web.json_response({"status": "ok" if ok else "unavailable", "workers": workers,
                                  "open_requests": status.num_open_requests}, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def index(self, request: web.Request) -> web.StreamResponse:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            raise web.HTTPNotFound(text="the demo page is not installed")
        return web.FileResponse(page)


class _HttpError(Exception):
    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def _event(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + _encode(payload) + b"\n\n"
