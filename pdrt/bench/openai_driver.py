"""The benchmark over the OpenAI HTTP API, so it can drive any OpenAI-compatible server.

Requests are streamed (server-sent events) with `stream_options:
{"include_usage": true}`; the first chunk with output is the first token,
each chunk's arrival stamps one token, and the usage the server reports at
the end is the count of output tokens (chunks are not tokens: a server may
hold back a token whose text is an incomplete character). `max_tokens` caps
the answer; the API has no standard way to ignore EOS, so an answer may end
early and the record keeps the real count (`extra_body` can pass a server's
own switch, such as vLLM's `ignore_eos`).

Text prompts are random words; `open` measures how many tokens the server's
tokenizer makes of them (a prompt of known words, one token asked for, its
usage read), so prompts come out near the length the workload asked for.
"""

import json

import aiohttp
import msgspec

from pdrt.bench.driver import Clock, ServerInfo, Target
from pdrt.bench.prompts import DEFAULT_VOCAB_SIZE, PromptBuilder, probe_text
from pdrt.bench.record import RequestRecord
from pdrt.bench.workloads import RequestShape
from pdrt.errors import ConfigError, ServerUnreachableError

PROBE_WORDS = 200
_decode = msgspec.json.Decoder().decode  # a chunk a token: the client shares the server's cores


def _base_url(address: str) -> str:
    base = address.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class OpenAIDriver:
    name = "openai"

    def __init__(self, target: Target) -> None:
        if target.endpoint not in ("completions", "chat"):
            raise ConfigError(f"endpoint must be 'completions' or 'chat', got {target.endpoint!r}")
        if target.prompt_format not in ("text", "ids"):
            raise ConfigError(f"prompt format must be 'text' or 'ids', got {target.prompt_format!r}")
        if target.prompt_format == "ids" and target.endpoint == "chat":
            raise ConfigError("token-id prompts need the completions endpoint")
        self.target = target
        self.base = _base_url(target.address)
        self.model = target.model
        self.headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self.session: aiohttp.ClientSession | None = None
        self.prompts = PromptBuilder(0, "", target.vocab_size or DEFAULT_VOCAB_SIZE)

    async def open(self) -> ServerInfo:
        # No pool limit: the benchmark's own in-flight cap is the only one, or the load would not be open.
        self.session = aiohttp.ClientSession(headers=self.headers, connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None,
                                                                           sock_read=self.target.request_timeout_s))
        try:
            async with self.session.get(self.base + "/models") as response:
                response.raise_for_status()
                models = (await response.json()).get("data") or []
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            raise ServerUnreachableError(f"could not list the models at {self.base}/models: {exc}") from exc
        listed = next((m for m in models if m.get("id") == self.model), models[0] if models else {})
        if self.model is None:
            if not listed:
                raise ConfigError(f"{self.base}/models lists no model; name one with --model")
            self.model = listed["id"]
        max_len = listed.get("max_model_len") if isinstance(listed, dict) else None
        tokens_per_word = await self._tokens_per_word() if self.target.prompt_format == "text" else 1.0
        self.prompts.tokens_per_word = tokens_per_word
        return ServerInfo(str(self.model), int(max_len) if max_len else None, tokens_per_word)

    async def _tokens_per_word(self) -> float:
        """Prompt tokens per word of the prompts' kind, from the usage of one small request (1.0 if none)."""
        body = self._body(probe_text(PROBE_WORDS), 1, stream=False)
        assert self.session is not None
        async with self.session.post(self._url, json=body) as response:
            if response.status >= 400:
                raise ServerUnreachableError(f"the server refused a probe request ({response.status}): "
                                             f"{(await response.text())[:300]}")
            usage = (await response.json()).get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens")
        return prompt_tokens / PROBE_WORDS if prompt_tokens else 1.0

    def set_prompts(self, seed: int, salt: str) -> None:
        self.prompts = PromptBuilder(seed, salt, self.prompts.vocab_size, self.prompts.tokens_per_word)

    @property
    def _url(self) -> str:
        return self.base + ("/chat/completions" if self.target.endpoint == "chat" else "/completions")

    def _body(self, prompt: str | list[int], max_tokens: int, stream: bool, seed: int | None = None) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": self.target.temperature,
                      "stream": stream}
        if self.target.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        if seed is not None:
            body["seed"] = seed
        return {**body, **self.target.extra_body}

    def _prompt(self, index: int, shape: RequestShape) -> str | list[int]:
        if self.target.prompt_format == "ids":
            return self.prompts.token_ids(index, shape)
        return self.prompts.text(index, shape)

    async def send(self, index: int, shape: RequestShape, record: RequestRecord, clock: Clock) -> None:
        assert self.session is not None, "open() first"
        body = self._body(self._prompt(index, shape), shape.output_tokens, stream=True, seed=index)
        record.sent(clock())
        usage: dict = {}
        finish_reason = None
        try:
            async with self.session.post(self._url, json=body) as response:
                if response.status >= 400:
                    record.fail(clock(), _error_code(response.status, await response.text()))
                    return
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = _decode(data)
                    if "error" in chunk:
                        record.fail(clock(), _error_code(500, json.dumps(chunk)))
                        return
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        if _chunk_text(choice):
                            record.tokens(1, clock())
                        finish_reason = choice.get("finish_reason") or finish_reason
            record.finish(clock(), usage.get("completion_tokens"), usage.get("prompt_tokens"), finish_reason)
        except Exception as exc:  # aiohttp's, a timeout, a bad chunk: the record says so; the run goes on
            record.fail(clock(), type(exc).__name__)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    return (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")


def _error_code(status: int, text: str) -> str:
    """The error's code from an OpenAI error body, else the HTTP status."""
    try:
        error = json.loads(text).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (json.JSONDecodeError, AttributeError):
        code = None
    return str(code) if code else f"http_{status}"

