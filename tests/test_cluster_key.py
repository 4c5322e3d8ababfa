"""The internal plane under the cluster key, over real loopback sockets: key holders talk, everyone else is refused
before a message is decoded; among holders, an inbox takes each message only from the role that sends it, and a KV
source serves an export only to its decode worker, each block at most once."""

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import torch
import zmq
import zmq.asyncio
from zmq.utils import z85

from pdrt.actors import run
from pdrt.actors.cluster_key import ZAP_DOMAIN, ClusterKey, zap_handler
from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.errors import ConfigError, TransferError
from pdrt.node_config import NodeConfig
from pdrt.roles.gateway import WORKER_SENDERS
from pdrt.roles.messaging import Inbox, Senders
from pdrt.transport import TransferBackend, make_puller, make_source
from pdrt.wire import Abort, KVAck, RequestFailed, Withdrawn, encode

KEY = ClusterKey.generate()
SHAPE = (2, 2, 8, 4, 2, 8)


def test_a_key_is_40_characters_of_z85_and_a_config_refuses_anything_else():
    assert len(KEY.text) == 40 and ClusterKey.parse(KEY.text) == KEY and ClusterKey.parse("") is None
    for bad in ("short", "x" * 40 + "y", '"' * 40):
        with pytest.raises(ConfigError):
            NodeConfig(model="/m", cluster_key=bad)
    assert NodeConfig(model="/m", cluster_key=KEY.text).key == KEY


def curve_server(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A ROUTER under KEY bound on a free loopback port, and its address; it waits at most a second for a message."""
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.setsockopt(zmq.RCVTIMEO, 1000)
    KEY.secure(server, server=True)
    server.bind("tcp://127.0.0.1:*")
    return server, server.getsockopt_string(zmq.LAST_ENDPOINT)


def curve_client(ctx: zmq.Context, address: str, key: ClusterKey | None) -> zmq.Socket:
    """A DEALER that connects to `address`: under `key`, or knowing only the server's public key (None)."""
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    if key is not None:
        key.secure(client, server=False)
    else:
        client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
        client.curve_serverkey = KEY.public
    client.connect(address)
    return client


def gets_through(server: zmq.Socket, client: zmq.Socket) -> bool:
    client.send(b"hello")
    try:
        return server.recv_multipart()[-1] == b"hello"
    except zmq.Again:
        return False


def test_a_key_holder_gets_through_and_a_client_that_knows_only_the_public_key_does_not():
    ctx = zmq.Context()
    try:
        server, address = curve_server(ctx)
        assert gets_through(server, curve_client(ctx, address, KEY))
        assert not gets_through(server, curve_client(ctx, address, None))
        assert zap_handler(ctx).num_refused >= 1
    finally:
        ctx.destroy(linger=0)


def test_a_server_whose_zap_handler_died_refuses_every_client():
    """libzmq skips ZAP when no handler is bound, unless the server enforces its domain: then it must fail closed."""
    ctx = zmq.Context()
    try:
        server, address = curve_server(ctx)
        handler = zap_handler(ctx)

        def fail(request: list[bytes]) -> list[bytes]:
            raise zmq.ZMQError(zmq.EFAULT)

        handler._answer = fail  # the handler's own error path: it logs, closes its socket and ends
        trigger = curve_client(ctx, address, KEY)  # held: a collected socket closes before its handshake
        handler.thread.join(timeout=5)
        assert not handler.thread.is_alive()
        trigger.close()

        assert not gets_through(server, curve_client(ctx, address, None))
        assert not gets_through(server, curve_client(ctx, address, KEY))
    finally:
        ctx.destroy(linger=0)


def test_the_zap_handler_refuses_a_request_for_another_domain():
    ctx = zmq.Context()
    try:
        curve_server(ctx)
        handler = zap_handler(ctx)
        member = z85.decode(KEY.public)
        ours = handler._answer([b"1.0", b"1", ZAP_DOMAIN, b"127.0.0.1", b"", b"CURVE", member])
        theirs = handler._answer([b"1.0", b"2", b"global", b"127.0.0.1", b"", b"CURVE", member])
        assert ours[2] == b"200" and theirs[2] == b"400"
    finally:
        ctx.destroy(linger=0)


async def inbox_hears(senders: Senders, send: Callable[[zmq.asyncio.Context, str], Awaitable[list[zmq.Socket]]]
                      ) -> tuple[list[object], int]:
    """What an inbox under KEY that takes `senders` hands its handler while `send(ctx, address)` sends to it (and
    returns its sockets, kept open meanwhile), and how many handshakes its ZAP handler refused."""
    ctx = zmq.asyncio.Context()
    received: list[object] = []

    async def handler(message: object) -> None:
        received.append(message)

    inbox = Inbox(ctx, "tcp://127.0.0.1:*", handler, senders, KEY)
    inbox.start()
    try:
        sockets = await send(ctx, inbox.address)
        await asyncio.sleep(1.0)
        del sockets  # held until here: a socket that is collected closes, and drops what it has not sent
        return received, zap_handler(ctx).num_refused
    finally:
        inbox.close()
        ctx.destroy(linger=0)  # closes every socket the test made too


def test_an_inbox_hears_key_holders_and_refuses_everyone_else_before_decoding():
    async def send(ctx: zmq.asyncio.Context, address: str) -> list[zmq.Socket]:
        senders = {
            "holder": make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"gateway", key=KEY)),
            "no key": make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"gateway")),
            "another key": make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"gateway",
                                                       key=ClusterKey.generate())),
        }
        # Knows the cluster's public key (the server's) but not its secret: CURVE would let it in, ZAP does not.
        spy = ctx.socket(zmq.DEALER)
        spy.setsockopt(zmq.LINGER, 0)
        spy.curve_publickey, spy.curve_secretkey = zmq.curve_keypair()
        spy.curve_serverkey = KEY.public
        spy.setsockopt(zmq.IDENTITY, b"gateway")
        spy.connect(address)
        senders["spy"] = spy
        for name, sock in senders.items():
            await sock.send(encode(Abort(name)))
        decode = make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"decode-0", key=KEY))
        await decode.send(encode(Abort("from a decode worker")))  # Abort comes from gateways only
        await decode.send(encode(KVAck("acked")))
        return [*senders.values(), decode]

    received, refused = run(inbox_hears({Abort: ("gateway",), KVAck: ("decode",)}, send))
    assert received == [Abort("holder"), KVAck("acked")]
    assert refused >= 1  # the spy; the others fail the handshake itself


def test_an_inbox_drops_a_message_sent_in_another_process_name():
    async def send(ctx: zmq.asyncio.Context, address: str) -> list[zmq.Socket]:
        decode = make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"decode-1", key=KEY))
        await decode.send(encode(RequestFailed("r", "x", "forged", False, "decode-0")))
        await decode.send(encode(RequestFailed("r", "x", "own", False, "decode-1")))
        await decode.send(b"\x93" + b"\x91" * 50_000)  # nested past Python's recursion limit
        await decode.send(encode(Withdrawn("r", True, "decode-1")))  # a decode worker withdraws nothing
        return [decode]

    received, _ = run(inbox_hears({RequestFailed: ("decode",), Withdrawn: ("prefill",)}, send))
    assert received == [RequestFailed("r", "x", "own", False, "decode-1")]


def test_the_gateway_hears_a_withdraw_answered_by_a_split_worker_whatever_role_it_started_in():
    async def send(ctx: zmq.asyncio.Context, address: str) -> list[zmq.Socket]:
        moved = make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"decode-1", key=KEY))
        await moved.send(encode(Withdrawn("r", True, "decode-1")))  # a prefill worker since a role change
        colocated = make_socket(ctx, SocketSpec(zmq.DEALER, address, False, b"colocated-0", key=KEY))
        await colocated.send(encode(Withdrawn("s", True, "colocated-0")))  # never asked to withdraw
        return [moved, colocated]

    received, _ = run(inbox_hears(WORKER_SENDERS, send))
    assert received == [Withdrawn("r", True, "decode-1")]


@pytest.fixture
def tcp_source():
    source = make_source(TransferBackend.TCP, f"pdrt-test-{uuid.uuid4().hex[:10]}", "127.0.0.1", KEY)
    pool = source.allocate(SHAPE, torch.float32)
    pool.copy_(torch.randn(SHAPE))
    yield source, pool
    source.close()


def pull(source, identity: str, key: ClusterKey | None, block_ids: list[int], timeout_s: float = 5.0) -> torch.Tensor:
    dst = torch.zeros(SHAPE)
    puller = make_puller(dst, identity, key)
    try:
        puller.pull(source.descriptor, "req", block_ids, list(range(len(block_ids))), time.monotonic() + 60,
                    timeout_s)
    finally:
        puller.close()
    return dst


def test_a_kv_source_serves_an_export_only_to_its_decode_worker_and_each_block_once(tcp_source):
    source, pool = tcp_source
    source.export("req", [2, 3, 5], time.monotonic() + 60, "decode-0")
    dst = pull(source, "decode-0", KEY, [5, 2])
    assert torch.equal(dst[:, :, :2], pool[:, :, [5, 2]])
    with pytest.raises(TransferError, match="routed to another decode worker"):
        pull(source, "decode-1", KEY, [2])
    with pytest.raises(TransferError, match="more than once"):
        pull(source, "decode-0", KEY, [2, 2])
    with pytest.raises(TransferError, match="not exported"):
        pull(source, "decode-0", KEY, [2, 4])
    with pytest.raises(TransferError, match="no answer"):  # no key: the handshake never completes
        pull(source, "decode-0", None, [2], timeout_s=0.5)
    assert torch.equal(pull(source, "decode-0", KEY, [3])[:, :, 0], pool[:, :, 3])  # and it still serves


def test_a_process_without_the_key_refuses_to_start_and_says_why(tmp_path):
    (tmp_path / "node.json").write_bytes(NodeConfig(model="unused").to_json())
    env = {k: v for k, v in os.environ.items() if k != "PDRT_CLUSTER_KEY"}
    done = subprocess.run([sys.executable, "-m", "pdrt.process", "controller"], capture_output=True, text=True,
                          timeout=60, env={**env, "PDRT_NODE_CONFIG": str(tmp_path / "node.json")})
    assert done.returncode == 2 and "no cluster key" in done.stderr
