"""OpenAI's completion and chat-completion shapes, to and from pdrt's own messages.

Parsing turns a request body into a pdrt `Generate` (or the parameters of
a draft's submit): the parameters pdrt implements are mapped, a few that
change the output and that pdrt does not implement are refused with a 400
(rather than silently ignored), and the rest (user, metadata, ...) are
ignored as OpenAI-compatible servers do. Formatting builds the JSON bodies
and the server-sent-event chunks of both APIs.
"""

import time
import uuid
from typing import Any

from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import InvalidRequestError, PdrtError
from pdrt.wire import ChatMessage, Generate, Tokens, Usage

UNSUPPORTED_IF_SET = {"logit_bias": None, "tools": None, "functions": None, "response_format": None,
                      "logprobs": None, "echo": False, "best_of": 1, "suffix": None, "top_logprobs": None,
                      "presence_penalty": 0, "frequency_penalty": 0}
DEFAULT_MAX_TOKENS_COMPLETIONS = 16  # OpenAI's default for /v1/completions; chat defaults to the context


def _number(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be a {kind.__name__}, got {value!r}")
    return value


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """The sampling parameters of an OpenAI request body (raises InvalidRequestError or its subclasses)."""
    for name, neutral in UNSUPPORTED_IF_SET.items():
        if body.get(name) not in (None, neutral):
            raise InvalidRequestError(f"'{name}' is not supported by this server")
    if _number(body, "n", int, 1) != 1:
        raise InvalidRequestError("only n=1 is supported")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequestError("'stop' must be a string or a list of strings")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens",
                                                                       int, None)
    ignore_eos = body.get("ignore_eos", False)  # an extension vLLM also has: benchmarks force output lengths
    if not isinstance(ignore_eos, bool):
        raise InvalidRequestError("'ignore_eos' must be a boolean")
    return SamplingParams(temperature=_number(body, "temperature", float, 1.0),
                          top_p=_number(body, "top_p", float, 1.0), seed=_number(body, "seed", int, None),
                          max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos)


def chat_messages(body: dict) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError("each message needs a 'role' and a 'content'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidRequestError("only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise InvalidRequestError("a message's 'content' must be a string or a list of text parts")
        out.append(ChatMessage(m["role"], content))
    return out


def chat_request(body: dict, context_length: int) -> Generate:
    """`session_id`, a pdrt extension, lets a later warmup of the session prefill this conversation."""
    return Generate(uuid.uuid4().hex, messages=chat_messages(body), params=sampling_params(body, context_length),
                    stream=bool(body.get("stream", False)), session_id=str(body.get("session_id") or ""))


def completion_request(body: dict) -> Generate:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    params = sampling_params(body, DEFAULT_MAX_TOKENS_COMPLETIONS)
    stream = bool(body.get("stream", False))
    if isinstance(prompt, str):
        return Generate(uuid.uuid4().hex, prompt=prompt, params=params, stream=stream)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Generate(uuid.uuid4().hex, token_ids=prompt, params=params, stream=stream)
    raise InvalidRequestError("'prompt' must be a string, one string in a list, or a list of token ids")


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


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
