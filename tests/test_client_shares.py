"""No client shuts the others out alone: one connection holds at most half the open requests, drafts and warmup
reservations (answered `overloaded` past its share), its sessions are its own (no other client reads, overwrites,
warms or evicts them), and a flood of handshakes never makes the gateway forget a client with something open."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import OverloadedError
from pdrt.node_config import ControllerConfig, GatewayConfig, NodeConfig
from pdrt.roles import gateway as gateway_module
from pdrt.roles.gateway import Gateway
from pdrt.testing.node import free_port
from pdrt.typeahead import draft_book
from pdrt.typeahead.sessions import SessionStore
from pdrt.wire import (
    PROTOCOL_VERSION,
    Cancel,
    DraftAppend,
    DraftOpen,
    Generate,
    Hello,
    Ready,
    Tokens,
    client_reply_decoder,
    encode,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CHAT = [{"role": "user", "content": "hello"}]


def test_one_client_holds_at_most_its_share_of_open_requests(table, prompts):
    table.max_open_per_client = 2
    mine = [table.admit(b"a", f"r{i}", prompts[3], GREEDY, True, None) for i in range(2)]
    for req in mine:
        table.open(req)
    with pytest.raises(OverloadedError, match="its share"):
        table.admit(b"a", "r2", prompts[3], GREEDY, True, None)
    table.open(table.admit(b"b", "r0", prompts[3], GREEDY, True, None))  # another client is served
    table.cancel(b"a", "r0")
    table.open(table.admit(b"a", "r2", prompts[3], GREEDY, True, None))  # an ended one frees its place
    assert table.num_open_by == {b"a": 2, b"b": 1}


def test_one_client_holds_at_most_its_share_of_open_drafts(table):
    drafts = table.drafts
    drafts.max_per_client = 2
    for i in range(2):
        drafts.open(b"a", DraftOpen(f"d{i}"), None)
    with pytest.raises(OverloadedError, match="its share"):
        drafts.open(b"a", DraftOpen("d2"), None)
    drafts.open(b"b", DraftOpen("d0"), None)
    drafts.abandon(b"a", "d0")
    drafts.open(b"a", DraftOpen("d2"), None)
    assert drafts.num_open_by == {b"a": 2, b"b": 1}


def test_a_session_is_its_owners_and_a_flood_of_sessions_evicts_only_the_flooders():
    store = SessionStore(max_sessions=10, max_per_owner=6)
    store.record((b"a", "s"), CHAT, "hi")
    assert store.get((b"b", "s")) is None  # another client's session of the same name is not found
    store.record((b"b", "s"), CHAT, "intruder")
    assert store.get((b"a", "s"))[-1]["content"] == "hi"  # nor overwritten
    for i in range(1000):
        store.record((b"b", f"flood{i}"), CHAT, "x")
    assert store.get((b"a", "s")) is not None and store.num_by_owner == {b"a": 1, b"b": 6}
    for i in range(5):
        store.record((b"c", f"c{i}"), CHAT, "x")  # the store is full: the largest owner gives way
    assert store.get((b"a", "s")) is not None and store.num_by_owner == {b"a": 1, b"b": 4, b"c": 5}


def test_a_client_warms_only_its_own_sessions_within_its_rate_and_share(table):
    warmups = table.warmups
    warmups.reservations.max_per_owner = 2
    for i in range(4):
        warmups.remember((b"a", f"s{i}"), CHAT, "hi")
    warmups.warm("s0", b"b")  # a's session, named by another client
    assert not warmups.reservations.by_session and warmups.counters["warmups_unknown_session"] == 1
    warmups.warm("s3")  # a signed datagram names any client's session
    assert set(warmups.reservations.by_session) == {(b"a", "s3")}
    for i in range(3):
        warmups.warm(f"s{i}", b"a")
    assert set(warmups.reservations.by_session) == {(b"a", "s3"), (b"a", "s0")}  # its share of reservations
    assert warmups.counters["warmups_refused"] == 2
    for _ in range(100):  # far past its rate: refused before anything is tokenized
        warmups.warm("s2", b"a")
    assert warmups.counters["warmups_rate_limited"] > 50


def test_a_flood_of_handshakes_never_forgets_a_client_with_something_open(model_dirs, monkeypatch):
    monkeypatch.setattr(gateway_module, "MAX_CLIENTS", 3)
    config = NodeConfig(model=str(model_dirs["llama"]), gateway=GatewayConfig(port=free_port(), http_port=0),
                        controller=ControllerConfig(port=free_port()))
    asyncio.run(flood_handshakes(config))


async def flood_handshakes(config: NodeConfig) -> None:
    ctx = zmq.asyncio.Context()
    gateway = Gateway(config, "gateway", "test", ctx)
    live = zmq.Context.shadow(ctx.underlying).socket(zmq.DEALER)
    live.setsockopt(zmq.IDENTITY, b"live")
    live.setsockopt(zmq.RCVTIMEO, 5000)  # every wait has a timeout
    try:
        live.connect(config.gateway_address)
        time.sleep(0.2)  # the connection is made on ZeroMQ's I/O thread
        gateway._hello(b"live", Hello(PROTOCOL_VERSION))
        gateway._take(b"live", Generate("open", token_ids=[5, 6, 7], params=GREEDY))  # no worker: it stays open
        for i in range(100):  # Hello-and-disconnect: their replies find no peer
            gateway._hello(f"flood{i}".encode(), Hello(PROTOCOL_VERSION))
        assert b"live" in gateway.handshaken and len(gateway.handshaken) <= 3
        gateway._client_frame(b"live", [encode(Cancel("open"))])  # still known: its frames are taken
        replies = [client_reply_decoder.decode(live.recv()) for _ in range(2)]
        assert isinstance(replies[0], Ready)
        assert isinstance(replies[1], Tokens) and replies[1].finish_reason == "cancelled", replies[1]
    finally:
        live.close(linger=0)
        gateway.clients.close(linger=0)
        gateway.inbox.close()
        gateway.renders.close()
        gateway.outbox.close()
        ctx.destroy(linger=0)


def unsynced(drafts) -> int:
    return sum(d.text != d.synced_text for d in drafts.drafts.values())


def test_paused_drafts_are_tokenized_within_a_budget_per_tick(table, monkeypatch):
    monkeypatch.setattr(draft_book, "MAX_SYNC_CHARS", 4000)  # what the tiny model's context holds
    drafts = table.drafts
    for i in range(5):
        drafts.open(b"a", DraftOpen(f"d{i}"), None)
        drafts.append(b"a", DraftAppend(f"d{i}", "word " * 600))  # synced as it came
        drafts.append(b"a", DraftAppend(f"d{i}", "tail"))  # too little to sync on its own
        drafts.drafts[(b"a", f"d{i}")].last_activity -= 10  # the typist paused
    drafts.sync_paused(0.2)
    assert unsynced(drafts) == 4  # one tick tokenizes at most MAX_SYNC_CHARS: the gateway's loop never stalls on them
    for _ in range(4):
        drafts.sync_paused(0.2)
    assert unsynced(drafts) == 0
