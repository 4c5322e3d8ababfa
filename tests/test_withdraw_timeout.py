"""A withdraw that no prefill worker answers (the answer lost, or the worker wedged) does not strand its request:
after WITHDRAW_TIMEOUT_S the gateway's request table starts it again, and a late answer to the old attempt
changes nothing."""

import time
from collections import Counter

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import total
from pdrt.node_config import NodeConfig
from pdrt.roles import request_table
from pdrt.roles.messaging import Outbox
from pdrt.roles.request_table import RequestTable
from pdrt.roles.router import Router
from pdrt.testing.node import free_port
from pdrt.typeahead.draft_book import DraftBook
from pdrt.warmup.warmups import Warmups
from pdrt.wire import Abort, Load, PrefillRequest, Withdraw, Withdrawn, WorkerInfo, internal_decoder

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
TIMEOUT_S = 0.2


@pytest.fixture
def workers():
    """A prefill and a decode worker's inboxes that read what the gateway sends and never answer."""
    ctx = zmq.Context()
    inboxes = {}
    for role in ("prefill", "decode"):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVTIMEO, 5000)  # every wait has a timeout
        address = f"tcp://127.0.0.1:{free_port()}"
        sock.bind(address)
        inboxes[role] = (WorkerInfo(f"{role}-0", "i1", role, address, Load(num_free_blocks=100)), sock)
    yield inboxes
    ctx.destroy(linger=0)


@pytest.fixture
def table(model_dirs, tokenizer, workers):
    config = NodeConfig.from_json(msgspec.json.encode({"model": str(model_dirs["llama"])}))
    ctx = zmq.asyncio.Context()
    router = Router()
    router.update([info for info, _ in workers.values()])
    outbox = Outbox(ctx, "gateway-0")
    counters: Counter[str] = Counter()
    x = config.experimental
    ids = iter(range(1 << 30))

    def new_id() -> str:
        return f"gateway-0:{next(ids)}"

    drafts = DraftBook(tokenizer, 1 << 16, 2048, router, outbox, "prefill", x.max_drafts, x.draft_ttl_s, new_id,
                       counters)
    warmups = Warmups(x.warmup_max_reservations, x.warmup_ttl_s, tokenizer, 2048, router, outbox, "prefill", new_id,
                      counters)
    replies: list[msgspec.Struct] = []
    made = RequestTable(config, tokenizer, router, outbox, "tcp://127.0.0.1:1", drafts, warmups,
                        lambda _, frames: replies.extend(frames), "gateway-0")
    made.replies = replies
    yield made
    for sock in outbox.sockets.values():
        sock.close(linger=0)
    ctx.destroy(linger=0)


def received(sock: zmq.Socket) -> msgspec.Struct:
    _, payload = sock.recv_multipart()
    return internal_decoder.decode(payload)


def test_an_unanswered_withdraw_starts_the_request_again_and_a_late_answer_changes_nothing(table, workers, prompts,
                                                                                          monkeypatch):
    monkeypatch.setattr(request_table, "WITHDRAW_TIMEOUT_S", TIMEOUT_S)
    prefill_sock = workers["prefill"][1]
    req = table.admit(b"client", "r1", prompts[3], GREEDY, True, None)
    table.open(req)
    first = received(prefill_sock)
    assert isinstance(first, PrefillRequest) and first.token_ids == prompts[3]

    assert table._withdraw(req)
    asked = received(prefill_sock)
    assert isinstance(asked, Withdraw) and asked.request_id == first.request_id
    table.expire()
    assert req.withdrawing is not None and req.internal_id == first.request_id, "it restarted before the timeout"

    time.sleep(TIMEOUT_S * 1.5)
    table.expire()
    dropped, again = received(prefill_sock), received(prefill_sock)
    assert dropped == Abort(first.request_id)
    assert isinstance(again, PrefillRequest) and again.token_ids == prompts[3]
    assert again.request_id != first.request_id and req.attempt == 2 and req.withdrawing is None
    assert req.migrations == 0, "a restart of an unstarted prompt is not a migration"

    # The prefill worker's answer to the first attempt arrives at last: it names an attempt that is gone.
    table.withdrawn(Withdrawn(first.request_id, True, "prefill-0"))
    assert req.internal_id == again.request_id and req.prefill is not None and req.prefill.process_id == "prefill-0"
    assert total(list(table.metrics.registry.collect()), "pdrt_gateway_prefills_moved_total") == 0
    assert table.router.open_requests == Counter({"prefill-0": 1, "decode-0": 1})
    assert table.replies == [], "the client heard nothing of it"
