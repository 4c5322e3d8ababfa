"""How a new request enters the gateway: its prompt rendered, checked, then admitted and routed.

A `Generate` (or a draft's `DraftSubmit`) is checked for admission first
(its id unused, the open-request limit, its deadline), then its prompt is
rendered into token ids: in place when it is small, on the render thread
when it is large (pdrt/roles/prompt_renders.py), in which case it goes on
when the `Rendered` message comes back. Then the request table admits and
routes it. A `Cancel` of a request still being rendered ends it at once.
"""

from collections.abc import Callable

import msgspec

from pdrt.errors import DuplicateRequestError, InvalidRequestError, PdrtError
from pdrt.roles.prompt_renderer import PromptRenderer, text_chars
from pdrt.roles.prompt_renders import INLINE_CHARS, PromptRenders, Rendered
from pdrt.roles.request_table import RequestTable
from pdrt.typeahead.draft_book import DraftBook
from pdrt.warmup.warmups import Warmups
from pdrt.wire import DraftSubmit, Generate, Tokens


class RequestIntake:
    def __init__(self, prompts: PromptRenderer, renders: PromptRenders, table: RequestTable, drafts: DraftBook,
                 warmups: Warmups, reply: Callable[[bytes, msgspec.Struct], None]) -> None:
        self.prompts = prompts
        self.renders = renders
        self.table = table
        self.drafts = drafts
        self.warmups = warmups
        self.reply = reply

    def cancel(self, identity: bytes, request_id: str) -> None:
        if self.renders.cancel(identity, request_id):  # still being tokenized: it ends here and now
            self.reply(identity, Tokens(request_id, [], finished=True, finish_reason="cancelled"))
        else:
            self.table.cancel(identity, request_id)

    def _check_new(self, identity: bytes, request_id: str, timeout_s: float | None) -> None:
        """Raise the reason a new request `request_id` cannot open now."""
        if (identity, request_id) in self.renders:
            raise DuplicateRequestError(f"request {request_id!r} is already open")
        self.table.check_admission(identity, request_id, timeout_s, len(self.renders))

    def rendered(self, rendered: Rendered) -> None:
        """A large prompt is tokenized: its request goes on (or ends with the render's error)."""
        rendered.then(rendered.result if self.renders.finish(rendered) else None)

    def generate(self, identity: bytes, message: Generate) -> None:
        self._check_new(identity, message.request_id, message.timeout_s)
        num_chars = text_chars(message)
        self.prompts.check_chars(num_chars)

        def then(result: list[int] | PdrtError | None) -> None:
            if isinstance(result, PdrtError):
                raise result
            if result is not None:  # None: cancelled, or its client left, while it rendered
                self._open_generate(identity, message, result)

        if num_chars <= INLINE_CHARS:
            then(self.prompts.render(message))
        else:
            self.renders.start(identity, message.request_id, lambda renderer: renderer.render(message), then)

    def _open_generate(self, identity: bytes, message: Generate, ids: list[int]) -> None:
        req = self.table.admit(identity, message.request_id, ids, message.params, message.stream, message.timeout_s)
        if message.continuation:
            if not message.stream or len(message.continuation) >= message.params.max_tokens:
                raise InvalidRequestError("a continuation resumes a streamed request that has tokens left to make")
            logprobs = message.continuation_logprobs
            if message.params.logprobs and (logprobs is None or len(logprobs) != len(message.continuation)):
                raise InvalidRequestError("a continuation of a request with logprobs carries one per token")
            self.prompts.check(ids + message.continuation)
            req.resume(message.continuation, logprobs)
        if message.session_id and message.messages is not None:
            req.session_id = message.session_id
            req.messages = [{"role": m.role, "content": m.content} for m in message.messages]
        req.preferred = self.warmups.worker_for(identity, message.session_id)
        self.table.open(req)

    def submit(self, identity: bytes, message: DraftSubmit) -> None:
        draft = self.drafts.take(identity, message.draft_id)

        def then(result: list[int] | PdrtError | None) -> None:
            try:
                if isinstance(result, PdrtError):
                    raise result
                if result is None:  # cancelled, or its client left, while it rendered
                    self.drafts.drop(draft, "drafts_abandoned")
                    return
                params = msgspec.structs.replace(message.params, cache_salt=draft.cache_salt)
                req = self.table.admit(identity, message.request_id, self.prompts.check(result), params,
                                       message.stream, message.timeout_s)
            except PdrtError:
                self.drafts.drop(draft, "drafts_failed")
                raise
            if draft.messages is not None:
                req.session_id = draft.session_id
                req.messages = [*draft.messages, {"role": "user", "content": draft.text}]
            self.table.open(req, draft)

        try:
            self._check_new(identity, message.request_id, message.timeout_s)
        except PdrtError:
            self.drafts.drop(draft, "drafts_failed")
            raise
        if draft.tokens.num_chars <= INLINE_CHARS:
            then(draft.tokens.final_ids())
        else:
            self.renders.start(identity, message.request_id,
                               lambda renderer: renderer.check(draft.tokens.final_ids(renderer.tokenizer)), then)
