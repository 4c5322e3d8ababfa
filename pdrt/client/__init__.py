"""Python clients of pdrt's native protocol (docs/protocol.md): `AsyncClient` for asyncio, `Client` blocking.

    with Client("tcp://127.0.0.1:7100") as client:
        print(client.generate("Hello", params=SamplingParams(max_tokens=32)).text)
        for delta in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(delta.text, end="", flush=True)

Errors the server reports come back as the `pdrt.errors` class of their code.
"""

from pdrt.client.async_client import DEFAULT_TIMEOUT_S, AsyncClient, chat_messages
from pdrt.client.async_stream import AsyncStream
from pdrt.client.completion import Completion
from pdrt.client.error_codes import ERROR_CLASSES, error_from_reply
from pdrt.client.sync_client import Client, Stream
from pdrt.engine.sampling_params import SamplingParams
from pdrt.wire import ChatMessage, Ready, Status, Tokens, Usage

__all__ = ["DEFAULT_TIMEOUT_S", "ERROR_CLASSES", "AsyncClient", "AsyncStream", "ChatMessage", "Client", "Completion",
           "Ready", "SamplingParams", "Status", "Stream", "Tokens", "Usage", "chat_messages", "error_from_reply"]
