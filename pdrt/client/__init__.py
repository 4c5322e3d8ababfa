"""Python clients of pdrt's native protocol (docs/protocol.md): `AsyncClient` for asyncio, `Client` blocking.

    with Client("tcp://127.0.0.1:7100") as client:
        print(client.generate("Hello", params=SamplingParams(max_tokens=32)).text)
        for delta in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(delta.text, end="", flush=True)

A prompt can also stream in while the user types it (the server prefills
its stable part before Enter), and a UDP datagram can warm a session up
when the user focuses the input box:

    draft = client.draft(messages=conversation, session_id=sid)
    draft.set_text("What is th")      # on every keystroke
    draft.set_text("What is the capital of France?")
    for delta in draft.submit(SamplingParams(temperature=0)):
        print(delta.text, end="")
    send_warmup("127.0.0.1", 7102, key, sid, model)   # when the input box gets focus

Errors the server reports come back as the `pdrt.errors` class of their code.
"""

from pdrt.client.async_client import DEFAULT_TIMEOUT_S, AsyncClient, chat_messages
from pdrt.client.async_draft import AsyncDraft
from pdrt.client.async_stream import AsyncStream
from pdrt.client.completion import Completion
from pdrt.client.error_codes import ERROR_CLASSES, error_from_reply
from pdrt.client.sync_client import Client, Draft, Stream
from pdrt.engine.sampling_params import SamplingParams
from pdrt.warmup.datagram import send_warmup
from pdrt.wire import ChatMessage, Ready, Status, Tokens, Usage

__all__ = ["DEFAULT_TIMEOUT_S", "ERROR_CLASSES", "AsyncClient", "AsyncDraft", "AsyncStream", "ChatMessage", "Client",
           "Completion", "Draft", "Ready", "SamplingParams", "Status", "Stream", "Tokens", "Usage", "chat_messages",
           "error_from_reply", "send_warmup"]
