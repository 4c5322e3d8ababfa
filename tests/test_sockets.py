"""The socket helper over real loopback sockets."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from pdrt.actors import run
from pdrt.actors.sockets import SocketSpec, bound_address, make_socket
from pdrt.errors import ConfigError


def test_router_and_dealers_round_trip_by_identity():
    async def main():
        ctx = zmq.asyncio.Context()
        router = make_socket(ctx, SocketSpec(zmq.ROUTER, "tcp://127.0.0.1:*", bind=True))
        address = bound_address(router)
        assert address.startswith("tcp://127.0.0.1:") and not address.endswith("*")
        dealers = {name: make_socket(ctx, SocketSpec(zmq.DEALER, address, bind=False, identity=name))
                   for name in (b"p0", b"d0")}
        for name, dealer in dealers.items():
            await dealer.send_multipart([b"hello from " + name])
        seen = {}
        for _ in dealers:
            identity, body = await asyncio.wait_for(router.recv_multipart(), 5)
            seen[identity] = body
        assert seen == {b"p0": b"hello from p0", b"d0": b"hello from d0"}
        await router.send_multipart([b"d0", b"for d0"])
        assert await asyncio.wait_for(dealers[b"d0"].recv_multipart(), 5) == [b"for d0"]
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: no silent drop to an unknown peer
            await router.send_multipart([b"nobody", b"lost"])
        for sock in (router, *dealers.values()):
            sock.close()
        ctx.term()

    run(main())


def test_push_pull_carries_zero_copy_frames():
    async def main():
        ctx = zmq.asyncio.Context()
        pull = make_socket(ctx, SocketSpec(zmq.PULL, "tcp://127.0.0.1:*", bind=True))
        push = make_socket(ctx, SocketSpec(zmq.PUSH, bound_address(pull), bind=False))
        payload = bytearray(range(256)) * 4096  # 1 MiB, sent without a copy into the message
        await push.send_multipart([b"header", memoryview(payload)], copy=False)
        header, body = await asyncio.wait_for(pull.recv_multipart(), 5)
        assert header == b"header" and body == bytes(payload)
        push.close()
        pull.close()
        ctx.term()

    run(main())


def test_binding_a_taken_address_fails_as_a_config_error_and_leaks_no_socket():
    async def main():
        ctx = zmq.asyncio.Context()
        first = make_socket(ctx, SocketSpec(zmq.ROUTER, "tcp://127.0.0.1:*", bind=True))
        with pytest.raises(ConfigError, match="in use"):
            make_socket(ctx, SocketSpec(zmq.ROUTER, bound_address(first), bind=True))
        first.close()
        ctx.term()  # would block if the failed socket had been left open

    run(main())
