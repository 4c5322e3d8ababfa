"""Every exception pdrt raises on purpose, in one place.

Each carries a stable `code` so that a process boundary (the client protocol,
the HTTP front) can turn it into a typed error reply without string matching,
and a client can turn the reply back into the class (`error_classes`). A code
belongs to the one class that defines it; subclasses that only narrow where
an error comes from inherit theirs.
"""

import functools


class PdrtError(Exception):
    """Base of all pdrt errors."""

    code = "internal"


class InvalidRequestError(PdrtError):
    """The request itself is wrong; retrying it unchanged fails again."""

    code = "invalid_request"


class InvalidSamplingParamsError(InvalidRequestError):
    code = "invalid_sampling_params"


class PromptTooLongError(InvalidRequestError):
    code = "prompt_too_long"


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit in this worker's KV pool, even alone."""

    code = "request_too_large"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request"


class KVPoolFullError(PdrtError):
    """No free KV blocks right now; the same request may succeed later."""

    code = "kv_pool_full"


class UnknownRequestError(PdrtError):
    code = "unknown_request"


class ModelLoadError(PdrtError):
    """The checkpoint is missing, unreadable or of an unsupported architecture."""

    code = "model_load"


class UnsupportedModelError(ModelLoadError):
    code = "unsupported_model"


class ModelFetchError(PdrtError):
    code = "model_fetch"


class ActorStoppedError(PdrtError):
    """The actor a message was sent to has stopped (or stopped before replying)."""

    code = "actor_stopped"


class RequestTimeoutError(PdrtError):
    """A request did not finish before its deadline."""

    code = "timeout"


class AskTimeoutError(RequestTimeoutError):
    """An `ask` got no reply within its timeout: the request that asked has timed out."""


class OverloadedError(PdrtError):
    """More work is queued than the server admits; the same request may succeed later."""

    code = "overloaded"


class MailboxFullError(OverloadedError):
    """The actor's bounded mailbox is full; the sender should shed or retry later."""


class TransferError(PdrtError):
    """Moving KV between workers failed: unreachable source, expired lease, short or malformed data."""

    code = "transfer_failed"


class ProtocolError(PdrtError):
    """A frame that does not decode into its expected type, or a peer that speaks another version."""

    code = "invalid_frame"


class UnavailableError(PdrtError):
    """No live worker can take the request now (all dead, or none registered yet)."""

    code = "unavailable"


class WorkerLostError(PdrtError):
    """The worker serving a request died after the request had produced tokens."""

    code = "worker_lost"


class StepFailedError(PdrtError):
    """An engine step raised, and this request is the one to blame (it raised again in a step of its own). The
    gateway tries it on another worker; on the second worker it failed on, the request ends with this error."""

    code = "step_failed"


class GatewayLostError(UnavailableError):
    """The gateway a request was open on was lost, and the request could not go on on another (not streamed, not
    seeded, cancelled, or resumed too often): whatever it would have produced is lost with it."""

    code = "gateway_lost"


class RoleChangedError(PdrtError):
    """The worker a request ran on serves another role now: the request goes on elsewhere (internal: the gateway
    retries it, and a client never sees this code)."""

    code = "role_changed"


class StreamMovedError(PdrtError):
    """The decode worker a stream ran on sent it on to one with fewer streams (internal, as `role_changed`)."""

    code = "stream_moved"


class ConfigError(PdrtError):
    """A node config (TOML, flags, environment) that cannot be used."""

    code = "config"


class ServerError(PdrtError):
    """An error reply whose code names no local error class; `code` is the server's own."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ServerUnreachableError(UnavailableError):
    """No server answered the handshake at the address within the timeout."""

    code = "unreachable"


class ClientClosedError(PdrtError):
    """The client was closed while this call was waiting for the server."""

    code = "client_closed"


class ConnectionForgottenError(ProtocolError):
    """The gateway asked for a handshake on a connection that had made one: it restarted, and forgot it."""

    code = "handshake_required"


class UnsupportedVersionError(ProtocolError):
    """The peer speaks another protocol version."""

    code = "unsupported_version"


@functools.cache
def error_classes() -> dict[str, type[PdrtError]]:
    """Every code and the class that defines it."""
    classes: dict[str, type[PdrtError]] = {}
    pending: list[type[PdrtError]] = [PdrtError]
    while pending:
        cls = pending.pop(0)
        pending += cls.__subclasses__()
        if "code" in vars(cls):
            classes.setdefault(cls.code, cls)
    return classes


def error_for(code: str, message: str) -> PdrtError:
    """The error that `code` stands for, with `.code` exactly `code` (one no class defines is a `ServerError`)."""
    cls = error_classes().get(code)
    if cls is None:
        return ServerError(code, message)
    exc = cls(message)
    exc.code = code  # an instance attribute, so "handshake_required" stays itself on a ProtocolError
    return exc
