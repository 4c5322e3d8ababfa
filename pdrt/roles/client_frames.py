"""Turning what a client sent into a typed request, or into the error reply it deserves.

Everything from outside is hostile until it decodes: a message must be one
frame, within the size limit, msgpack of a known tag with fields of the
right types, and pass the structs' own validation (sampling parameters). A
frame that fails gets an `Error` naming why, with the request id when the
frame can be read far enough to find one, so the client can match it.
"""

import msgspec

from pdrt.errors import PdrtError
from pdrt.wire import MAX_CLIENT_FRAME_BYTES, RESERVED_TAGS, Error, client_request_decoder

_loose = msgspec.msgpack.Decoder()


def _peek(frame: bytes) -> tuple[str | None, str | None]:
    """The tag and request id of a frame that failed to decode, when they can be read at all."""
    try:
        raw = _loose.decode(frame)
    except msgspec.DecodeError:
        return None, None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        request_id = raw[1] if len(raw) > 1 and isinstance(raw[1], str) else None
        return raw[0], request_id
    return None, None


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
        tag, request_id = _peek(frame)
        if tag in RESERVED_TAGS:
            return Error("unsupported", f"{tag!r} is not supported by this server", request_id)
        return Error("invalid_frame", f"malformed client frame: {exc}", request_id)
    except PdrtError as exc:  # a struct's own validation, e.g. sampling parameters
        return Error(exc.code, str(exc), _peek(frame)[1])
