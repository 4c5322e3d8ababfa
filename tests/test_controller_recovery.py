"""A restarted controller knows nobody: for one lease from when it can read heartbeats, it marks its views
incomplete, so that no gateway drops a worker that has not registered again yet. On a busy host a controller may
take longer than a lease to start serving; the lease still runs from then."""

import asyncio

import msgspec
import zmq
import zmq.asyncio

from pdrt.control_plane.controller import Controller
from pdrt.control_plane.link import link_identity
from pdrt.node_config import NodeConfig
from pdrt.testing.node import free_port
from pdrt.wire import PROTOCOL_VERSION, ClusterView, Register, encode, internal_decoder

LEASE_S = 0.5


async def first_view_after_a_slow_start(config: NodeConfig) -> ClusterView:
    ctx = zmq.asyncio.Context()
    controller = Controller(config, ctx)
    await asyncio.sleep(3 * LEASE_S)  # constructed, not yet serving: a slow start
    stop = asyncio.Event()
    serving = asyncio.create_task(controller.serve(stop))
    gateway = ctx.socket(zmq.DEALER)
    gateway.setsockopt(zmq.IDENTITY, link_identity("gateway", "g1"))
    gateway.connect(config.controller_address)
    try:
        await gateway.send(encode(Register(PROTOCOL_VERSION, "gateway", "g1", "gateway", "tcp://127.0.0.1:1")))
        async with asyncio.timeout(10):
            while not isinstance(message := internal_decoder.decode(await gateway.recv()), ClusterView):
                pass
        return message
    finally:
        stop.set()
        await serving
        gateway.close(linger=0)
        ctx.destroy(linger=0)


def test_a_controller_that_starts_slowly_still_marks_its_first_views_incomplete():
    config = NodeConfig.from_json(msgspec.json.encode({
        "model": "unused", "controller": {"port": free_port(), "metrics_port": 0, "balance": False},
        "experimental": {"lease_s": LEASE_S}}))
    view = asyncio.run(first_view_after_a_slow_start(config))
    assert not view.complete
