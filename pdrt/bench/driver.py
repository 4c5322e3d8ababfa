"""How the benchmark talks to a server: one small interface, a driver per protocol.

A driver connects (`open`, which also learns the served model and its
context), then sends requests, each filling its `RequestRecord` as frames
arrive, and never raising: a failed request is a record with an error.
`make_driver` picks the driver for a `Target`: the native protocol for a
tcp:// or ipc:// address, the OpenAI HTTP API for an http(s):// base URL,
and imports it lazily.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdrt.bench.record import RequestRecord
from pdrt.bench.workloads import RequestShape
from pdrt.errors import ConfigError

Clock = Callable[[], float]


@dataclass(slots=True, frozen=True)
class ServerInfo:
    model: str
    max_model_len: int | None  # None when the server does not say (then --max-model-len must)
    tokens_per_word: float = 1.0  # text prompts only: what the server's tokenizer makes of a prompt word


@dataclass(slots=True)
class Target:
    """A server to benchmark. `address` is tcp://host:port (native) or http(s)://host:port[/v1] (OpenAI).

    `model` names the model for OpenAI servers (default: the first /v1/models lists). `endpoint` is
    "completions" or "chat". `prompt_format` is "ids" (token ids; native always, and OpenAI servers that
    take token-id prompts) or "text". `extra_body` is merged into every OpenAI request body (e.g.
    {"ignore_eos": true} for vLLM and SGLang, which honour it; strict servers refuse unknown fields).
    """

    address: str
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    prompt_format: str = "text"
    extra_body: dict = field(default_factory=dict)
    temperature: float = 0.0
    request_timeout_s: float = 300.0
    vocab_size: int | None = None

    @property
    def protocol(self) -> str:
        if self.address.startswith(("tcp://", "ipc://")):
            return "native"
        if self.address.startswith(("http://", "https://")):
            return "openai"
        raise ConfigError(f"cannot tell the protocol of {self.address!r}: give tcp://host:port for pdrt's native "
                          "protocol or http://host:port/v1 for an OpenAI-compatible server")


class Driver(Protocol):
    name: str

    async def open(self) -> ServerInfo:
        """Connect, and say what is served; raises a PdrtError when the server cannot be reached."""
        ...

    async def send(self, index: int, shape: RequestShape, record: RequestRecord, clock: Clock) -> None:
        """Send one request with the prompt for (`index`, `shape`) and fill `record`; never raises."""
        ...

    def set_prompts(self, seed: int, salt: str) -> None:
        """Use fresh prompt content for the next run (a sweep's runs must not share a prefix cache)."""
        ...

    async def close(self) -> None:
        ...


def make_driver(target: Target) -> Driver:
    if target.protocol == "native":
        from pdrt.bench.native_driver import NativeDriver

        return NativeDriver(target)
    from pdrt.bench.openai_driver import OpenAIDriver

    return OpenAIDriver(target)
