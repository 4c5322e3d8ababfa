"""A prefill worker gives a prompt back (`Withdraw`) only while nothing of it has begun: still waiting in its
scheduler, or admitted while a step ran and not yet added; and its load accounts for every prompt it holds, and
for the tokens they may still produce."""


import msgspec
import pytest
import zmq
import zmq.asyncio

from pdrt.engine.sampling_params import SamplingParams
from pdrt.node_config import NodeConfig
from pdrt.roles.split_worker import SplitWorker
from pdrt.wire import PrefillRequest, Withdraw, Withdrawn, internal_decoder

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CHUNK = 32


@pytest.fixture
def make_worker(model_dirs):
    made: list[tuple[SplitWorker, zmq.asyncio.Context]] = []

    def make(**prefill) -> SplitWorker:
        config = NodeConfig.from_json(msgspec.json.encode({
            "model": str(model_dirs["llama"]), "prefill": prefill,
            "engine": {"kv_cache_bytes": 64 << 20, "max_prefill_chunk_size": CHUNK}}))
        ctx = zmq.asyncio.Context()
        made.append((SplitWorker(config, "prefill-0", "test", ctx, "withdraw-test", "prefill"), ctx))
        return made[-1][0]

    yield make
    for worker, ctx in made:
        worker.inbox.close()
        worker.shut_down()
        ctx.destroy(linger=0)


@pytest.fixture
def worker(make_worker):
    return make_worker()


@pytest.fixture
def gateway_inbox(silent_inbox):
    return silent_inbox


def withdraw(worker: SplitWorker, gateway_inbox, request_id: str) -> bool:
    sock, address = gateway_inbox
    worker.handoffs.withdraw(Withdraw(request_id, address))
    _, payload = sock.recv_multipart()
    answer = internal_decoder.decode(payload)
    assert isinstance(answer, Withdrawn) and answer.request_id == request_id
    return answer.withdrawn


def test_a_prompt_is_given_back_until_it_begins_and_the_load_accounts_for_each(worker, gateway_inbox, prompts):
    _, address = gateway_inbox
    for i, rid in enumerate(("a", "b", "c")):  # 200 tokens each, no prefix shared
        worker.handoffs.admit(PrefillRequest(rid, prompts[-1 - i][:200], GREEDY, address, "tcp://127.0.0.1:1"))
    # Admitted while a step ran, its add not yet run: "b" goes back, and is never added.
    assert withdraw(worker, gateway_inbox, "b")
    worker._apply_ops()
    assert set(worker.engine.sequences) == {"a", "c"} and not worker.handoffs.unadded
    worker.engine.step()  # the first chunk of "a": it has begun
    load = worker._measure_load()
    assert load.prefilling == ["a"]
    assert load.first_token_work == {"a": 200 - CHUNK, "c": 400 - CHUNK}
    assert load.num_tokens_left == 2 * GREEDY.max_tokens  # what the balancer weighs a worker's streams by
    assert not withdraw(worker, gateway_inbox, "a")  # begun: it stays
    assert withdraw(worker, gateway_inbox, "c")  # still waiting in the scheduler
    assert not withdraw(worker, gateway_inbox, "unknown")
    worker._apply_ops()
    assert set(worker.engine.sequences) == {"a"} and set(worker.handoffs.requests) == {"a"}
    assert worker._measure_load().first_token_work == {"a": 200 - CHUNK}
    assert worker._measure_load().num_tokens_left == GREEDY.max_tokens

