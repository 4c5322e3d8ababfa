"""Turning a server's `Error` frame back into the exception the server raised.

The server sends a stable `code` string, never a class name. The client maps
each code to the local `PdrtError` subclass that defines it
(`pdrt.errors.error_classes`), so that callers catch `PromptTooLongError` on
either side of the wire. A code no class defines (one from a newer server)
still becomes a typed error, a `ServerError`. Either way `.code` is exactly
the server's code.
"""

from pdrt.errors import PdrtError, error_classes, error_for
from pdrt.wire import Error

ERROR_CLASSES: dict[str, type[PdrtError]] = error_classes()


def error_from_reply(reply: Error) -> PdrtError:
    """The exception an `Error` frame stands for, with `.code` equal to the frame's code."""
    return error_for(reply.code, reply.message)
