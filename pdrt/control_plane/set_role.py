"""Ask the controller to change a worker's role, and wait until the worker serves it: `pdrt role`, tests, benchmarks.

Only a holder of the cluster key reaches the controller; the answer is the
worker's `RoleChanged` (with how many streams it moved), or an error that
says why the change cannot be made (`invalid_request`) or why it did not
finish (`worker_lost`: the worker died during it).
"""

import asyncio
import secrets

import msgspec
import zmq
import zmq.asyncio

from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.errors import InvalidRequestError, RequestTimeoutError, error_classes
from pdrt.wire import Error, RoleChanged, SetRole, encode, internal_decoder


async def set_role(controller_address: str, key: ClusterKey, process_id: str, role: str,
                   timeout_s: float = 15.0) -> RoleChanged:
    """Make `process_id` serve as `role` ("prefill" or "decode"); its `RoleChanged` once it does."""
    ctx = zmq.asyncio.Context.instance()
    identity = f"operator-{secrets.token_hex(8)}".encode()
    sock = make_socket(ctx, SocketSpec(zmq.DEALER, controller_address, bind=False, identity=identity, key=key))
    try:
        await sock.send(encode(SetRole(process_id, role)))
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    reply = internal_decoder.decode(await sock.recv())
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if isinstance(reply, Error):
                    raise error_classes().get(reply.code, InvalidRequestError)(reply.message)
                if isinstance(reply, RoleChanged):
                    return reply
    except TimeoutError:
        raise RequestTimeoutError(f"no answer from the controller at {controller_address} within {timeout_s:g} s")\
            from None
    finally:
        sock.close(linger=0)
