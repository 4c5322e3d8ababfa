"""An abort that reaches a prefill worker after its handoff (the gateway sends one when the decode worker is lost
mid-handoff): the KV stays exported until the decode worker acknowledges, the lease runs out, or the decode worker
is known to have exited, since until then it may be copying it; then it is freed once, and the worker goes on
serving. A lost gateway's requests are dropped, until its inbox says it is a live gateway's."""

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdrt.engine.sampling_params import SamplingParams
from pdrt.node_config import NodeConfig
from pdrt.roles.split_worker import SplitWorker
from pdrt.wire import Abort, GatewayBack, KVAck, KVHandoff, PrefillRequest, ProcessLost, StepOutputs, internal_decoder

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture
def worker(model_dirs):
    config = NodeConfig.from_json(msgspec.json.encode({
        "model": str(model_dirs["llama"]), "engine": {"kv_cache_bytes": 64 << 20},
        "experimental": {"kv_lease_s": 30.0}}))
    ctx = zmq.asyncio.Context()
    made = SplitWorker(config, "prefill-0", "test", ctx, "handoff-abort-test", "prefill")
    yield made
    made.inbox.close()
    made.shut_down()
    ctx.destroy(linger=0)


@pytest.fixture
def peer(silent_inbox):
    """Stands for both the gateway and a frozen decode worker: it receives, never answers."""
    return silent_inbox


def receive(sock: zmq.Socket, kind: type) -> object:
    while True:
        message = internal_decoder.decode(sock.recv_multipart()[1])
        if isinstance(message, kind):
            return message


def hand_off(worker: SplitWorker, peer, prompt: list[int], rid: str) -> KVHandoff:
    sock, address = peer
    worker.handoffs.admit(PrefillRequest(rid, prompt, GREEDY, address, address, "decode-0"))
    worker._apply_ops()
    while rid not in worker.handoffs.held:
        worker.emit(worker.engine.step())
    assert isinstance(receive(sock, StepOutputs), StepOutputs)  # the first token went to the gateway
    return receive(sock, KVHandoff)


def deliver(worker: SplitWorker, message: object) -> None:
    asyncio.run(worker.on_receive(message))


def used_blocks(worker: SplitWorker) -> int:
    manager = worker.engine.block_manager
    return manager.num_blocks - manager.num_free_blocks


def test_an_abort_after_the_handoff_keeps_the_kv_until_the_lease_runs_out_and_the_worker_serves_on(
        worker, peer, prompts):
    handoff = hand_off(worker, peer, prompts[8], "a")
    deliver(worker, Abort("a"))
    worker._apply_ops()
    assert used_blocks(worker) == len(handoff.block_ids)  # the decode worker may still be copying them
    worker.handoffs.held["a"] = worker.handoffs.held["a"]._replace(deadline=time.monotonic() - 1)  # the lease ends
    worker.after_step()
    assert used_blocks(worker) == 0 and not worker.engine.sequences and not worker.handoffs.held
    assert hand_off(worker, peer, prompts[9], "b").request_id == "b"  # and it serves on


def test_an_acknowledgement_after_an_abort_frees_the_kv_once(worker, peer, prompts):
    hand_off(worker, peer, prompts[8], "a")
    deliver(worker, Abort("a"))
    deliver(worker, KVAck("a"))
    worker._apply_ops()
    assert used_blocks(worker) == 0 and not worker.engine.sequences and not worker.handoffs.held
    worker.after_step()
    deliver(worker, KVAck("a"))  # a second acknowledgement finds nothing to free
    worker._apply_ops()
    assert hand_off(worker, peer, prompts[9], "b").request_id == "b"


def test_the_kv_handed_to_a_decode_worker_that_exited_is_freed_at_once(worker, peer, prompts):
    hand_off(worker, peer, prompts[8], "a")
    deliver(worker, ProcessLost("decode-1", "x", "tcp://127.0.0.1:1", exited=True))  # another's: nothing moves
    worker._apply_ops()
    assert worker.handoffs.held
    deliver(worker, ProcessLost("decode-0", "x", "tcp://127.0.0.1:1", exited=False))  # lost, maybe only frozen
    worker._apply_ops()
    assert worker.handoffs.held
    deliver(worker, ProcessLost("decode-0", "x", "tcp://127.0.0.1:1", exited=True))
    worker._apply_ops()
    assert used_blocks(worker) == 0 and not worker.handoffs.held and not worker.engine.sequences



def test_requests_from_a_lost_gateways_inbox_are_dropped_until_it_says_it_is_a_live_gateways(worker, peer, prompts):
    _, address = peer
    deliver(worker, ProcessLost("gateway", "old", address))
    deliver(worker, PrefillRequest("late", prompts[8], GREEDY, address, address, "decode-0"))
    assert "late" not in worker.handoffs.requests  # sent before the gateway died: nobody would receive it
    deliver(worker, GatewayBack(address))  # a gateway bound that inbox again, or thawed
    assert hand_off(worker, peer, prompts[9], "new").request_id == "new"
