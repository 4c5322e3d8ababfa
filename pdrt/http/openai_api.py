"""OpenAI's completion and chat-completion shapes, to and from pdrt's own messages.

Parsing decodes a request body straight into its type (`ChatBody`,
`CompletionBody`, the draft and warmup bodies): a field of the wrong type or
out of range is a 400 naming where it is (`$.temperature`), before anything
else happens. The parameters pdrt implements are mapped; a few that change
the output and that pdrt does not implement are refused when set (rather
than silently ignored); unknown keys (user, metadata, ...) are ignored, as
OpenAI-compatible servers do. Formatting builds the JSON bodies and the
server-sent-event chunks of both APIs.
"""

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from pdrt.engine.sampling_params import MAX_INT, SamplingParams
from pdrt.errors import InvalidRequestError, PdrtError
from pdrt.wire import ChatMessage, Generate, Tokens, Usage

DEFAULT_MAX_TOKENS_COMPLETIONS = 16  # OpenAI's default for /v1/completions; chat defaults to the context
UNSUPPORTED_IF_SET = {"logit_bias": None, "tools": None, "functions": None, "response_format": None,
                      "logprobs": None, "echo": False, "best_of": 1, "suffix": None, "top_logprobs": None,
                      "presence_penalty": 0, "frequency_penalty": 0}
Count = Annotated[int, Meta(ge=1, le=MAX_INT)]

Body = TypeVar("Body")


def decode_body(data: bytes, kind: type[Body]) -> Body:
    """The request body `data` as `kind`, or InvalidRequestError saying what is wrong and where."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request body: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str = ""


class MessageBody(msgspec.Struct):
    role: str
    content: str | list[TextPart]

    def chat_message(self) -> ChatMessage:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(self.role, content)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ParamsBody(msgspec.Struct, kw_only=True):
    """The sampling parameters and streaming options every generating body shares."""

    # Null is as good as absent for every field, as OpenAI's own server takes it.
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: Literal[1] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # an extension vLLM also has: benchmarks force output lengths
    speculate: bool | None = None  # a pdrt extension: false verifies no proposed tokens (one token a step)
    cache_salt: str | None = None  # as vLLM's: cached prompt KV is shared only among requests of an equal salt
    # Refused when set to anything but their neutral value (UNSUPPORTED_IF_SET).
    logit_bias: Any = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None
    logprobs: Any = None
    echo: Any = False
    best_of: Any = 1
    suffix: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = 0
    frequency_penalty: Any = 0

    def __post_init__(self) -> None:
        for name, neutral in UNSUPPORTED_IF_SET.items():
            if getattr(self, name) not in (None, neutral):
                raise InvalidRequestError(f"'{name}' is not supported by this server")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, max_tokens=max_tokens,
                              stop=stop, ignore_eos=bool(self.ignore_eos), speculate=self.speculate is not False,
                              cache_salt=self.cache_salt or "")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatBody(ParamsBody, kw_only=True):
    messages: Annotated[list[MessageBody], Meta(min_length=1)]
    session_id: str | None = ""  # a pdrt extension: a later warmup of the session prefills this conversation

    def generate(self, context_length: int) -> Generate:
        return Generate(uuid.uuid4().hex, messages=[m.chat_message() for m in self.messages],
                        params=self.sampling_params(context_length), stream=bool(self.stream),
                        session_id=self.session_id or "")


class CompletionBody(ParamsBody, kw_only=True):
    prompt: str | Annotated[list[str | int], Meta(min_length=1)]  # a string, one string in a list, or token ids

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.prompt, list) and not (
                (len(self.prompt) == 1 and isinstance(self.prompt[0], str))
                or all(isinstance(t, int) for t in self.prompt)):
            raise InvalidRequestError("'prompt' must be a string, one string in a list, or a list of token ids")

    def generate(self) -> Generate:
        params = self.sampling_params(DEFAULT_MAX_TOKENS_COMPLETIONS)
        prompt, stream = self.prompt, bool(self.stream)
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            text = prompt if isinstance(prompt, str) else prompt[0]
            return Generate(uuid.uuid4().hex, prompt=str(text), params=params, stream=stream)
        return Generate(uuid.uuid4().hex, token_ids=[int(t) for t in prompt], params=params, stream=stream)


class DraftOpenBody(msgspec.Struct):
    messages: list[MessageBody] | None = None  # the conversation so far; None: a plain prompt
    session_id: str | None = ""
    cache_salt: str | None = None  # the submitted request's too

    def chat_messages(self) -> list[ChatMessage] | None:
        return None if self.messages is None else [m.chat_message() for m in self.messages]


class DraftTextBody(msgspec.Struct):
    text: str


class DraftSubmitBody(ParamsBody, kw_only=True):
    pass


class WarmupBody(msgspec.Struct):
    session_id: Annotated[str, Meta(min_length=1)]


def _usage(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class Response:
    """One OpenAI response, built from pdrt's `Tokens` frames (chat or plain completion)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def add(self, frame: Tokens) -> None:
        self.text += frame.text
        if frame.finished:
            self.finish_reason = frame.finish_reason
            self.usage = frame.usage

    def body(self) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "finish_reason": self.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self.finish_reason, "logprobs": None}
        return {**self._envelope([choice], chunk=False), "usage": _usage(self.usage)}

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role."""
        if not self.chat:
            return None
        return self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                "logprobs": None}], chunk=True)

    def chunk(self, frame: Tokens) -> dict | None:
        if not frame.text and not frame.finished:
            return None
        finish = frame.finish_reason if frame.finished else None
        if self.chat:
            delta = {"content": frame.text} if frame.text else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": frame.text, "finish_reason": finish, "logprobs": None}
        return self._envelope([choice], chunk=True)

    def usage_chunk(self) -> dict:
        return {**self._envelope([], chunk=True), "usage": _usage(self.usage)}


ERROR_STATUS = {"invalid_request": 400, "invalid_sampling_params": 400, "prompt_too_long": 400,
                "request_too_large": 400, "duplicate_request": 400, "unknown_request": 404, "unauthorized": 401,
                "overloaded": 429, "unavailable": 503, "timeout": 504, "worker_lost": 503, "transfer_failed": 503}


def error_body(code: str, message: str) -> tuple[int, dict]:
    """OpenAI's error shape and the HTTP status of a pdrt error code."""
    status = ERROR_STATUS.get(code, 500)
    kind = "invalid_request_error" if status < 500 and status != 429 else \
        "rate_limit_error" if status == 429 else "server_error"
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_of(exc: PdrtError) -> tuple[int, dict]:
    return error_body(exc.code, str(exc))
