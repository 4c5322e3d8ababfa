"""Turning a server's `Error` frame back into the exception the server raised.

The server sends a stable `code` string, never a class name. The client maps
each code it knows to the local `PdrtError` subclass of that code, so that
callers catch `PromptTooLongError` on either side of the wire. A code with no
class of its own (the gateway's protocol codes, or one from a newer server)
still becomes a typed error: a `ProtocolError` for handshake failures, a
`ServerError` otherwise. Either way `.code` is exactly the server's code.
"""

from pdrt.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    KVPoolFullError,
    ModelFetchError,
    ModelLoadError,
    OverloadedError,
    PdrtError,
    PromptTooLongError,
    ProtocolError,
    RequestTimeoutError,
    RequestTooLargeError,
    ServerError,
    TransferError,
    UnavailableError,
    UnknownRequestError,
    UnsupportedError,
    UnsupportedModelError,
    WorkerLostError,
)
from pdrt.wire import Error

ERROR_CLASSES: dict[str, type[PdrtError]] = {
    "invalid_request": InvalidRequestError,
    "invalid_sampling_params": InvalidSamplingParamsError,
    "prompt_too_long": PromptTooLongError,
    "request_too_large": RequestTooLargeError,
    "duplicate_request": DuplicateRequestError,
    "kv_pool_full": KVPoolFullError,
    "unknown_request": UnknownRequestError,
    "timeout": RequestTimeoutError,
    "overloaded": OverloadedError,
    "transfer_failed": TransferError,
    "unsupported": UnsupportedError,
    "unavailable": UnavailableError,
    "worker_lost": WorkerLostError,
    "model_load": ModelLoadError,
    "unsupported_model": UnsupportedModelError,
    "model_fetch": ModelFetchError,
    "config": ConfigError,
    # The gateway's handshake and framing codes: all are protocol failures.
    "invalid_frame": ProtocolError,
    "handshake_required": ProtocolError,
    "unsupported_version": ProtocolError,
}


def error_from_reply(reply: Error) -> PdrtError:
    """The exception an `Error` frame stands for, with `.code` equal to the frame's code."""
    cls = ERROR_CLASSES.get(reply.code)
    if cls is None:
        return ServerError(reply.code, reply.message)
    exc = cls(reply.message)
    exc.code = reply.code  # an instance attribute, so "handshake_required" stays itself on a ProtocolError
    return exc
