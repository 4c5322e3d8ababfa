"""Turning what a client sent into a typed request, or into the error reply it deserves.

Everything from outside is hostile until it decodes: a message must be one
frame, within the size limit, msgpack of a known tag with fields of the
right types, and pass the structs' own validation (sampling parameters). A
frame that fails gets an `Error` naming why, with the request id when the
frame can be read far enough to find one, so the client can match it.
"""

import msgspec

from pdrt.errors import PdrtError
from pdrt.wire import MAX_CLIENT_FRAME_BYTES, Error, client_request_decoder

_loose = msgspec.msgpack.Decoder()


def _peek(frame: bytes) -> str | None:
    """The request (or draft) id of a frame that failed to decode, when it can be read at all."""
    try:
        raw = _loose.decode(frame)
    except (msgspec.DecodeError, RecursionError):  # nested deeper than Python recurses: unreadable
        return None
    if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str):
        return raw[1]
    return None


def decode_client_frames(frames: list[bytes]) -> object:
    """The client request in `frames`, or the `Error` to answer it with."""
    if len(frames) != 1:
        return Error("invalid_frame", f"a client message is one frame, got {len(frames)}")
    frame = frames[0]
    if len(frame) > MAX_CLIENT_FRAME_BYTES:
        return Error("invalid_frame", f"frame of {len(frame)} bytes exceeds the limit of {MAX_CLIENT_FRAME_BYTES}")
    try:
        return client_request_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Error("invalid_frame", f"malformed client frame: {exc}", _peek(frame))
    except PdrtError as exc:  # a struct's own validation, e.g. sampling parameters
        return Error(exc.code, str(exc), _peek(frame))
