"""A request moves on when a worker dies or fails it, but one that failed on `max_request_failures` (2) workers ends
with the typed error of its last failure, with or without output: one poisoned request takes no node down. A move
that is no failure (a role change, a crowded worker, a full pool) does not count."""

from pdrt.engine.sampling_params import SamplingParams
from pdrt.wire import Error, PrefillRequest, RequestFailed
from tests.conftest import received

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def sent(workers) -> PrefillRequest:
    message = received(workers["prefill"][1])
    while not isinstance(message, PrefillRequest):  # the aborts of the attempts before
        message = received(workers["prefill"][1])
    return message


def test_a_request_that_fails_a_step_on_two_workers_ends_with_step_failed(table, workers, prompts):
    req = table.admit(b"client", "r1", prompts[3], GREEDY, True, None)
    table.open(req)
    first = sent(workers)
    table.failed(RequestFailed(first.request_id, "step_failed", "boom", True, "prefill-0"))
    second = sent(workers)
    assert second.request_id != first.request_id and not table.replies  # tried again, the client told nothing
    table.failed(RequestFailed(second.request_id, "step_failed", "boom", True, "prefill-0"))
    assert [(r.code, r.request_id) for r in table.replies] == [("step_failed", "r1")]
    assert "failed on 2 workers" in table.replies[0].message and not table.by_client and not table.requests


def test_a_request_whose_workers_die_before_its_first_token_ends_with_worker_lost(table, workers, prompts):
    req = table.admit(b"client", "r1", prompts[3], GREEDY, True, None)
    table.open(req)
    prefill = workers["prefill"][0]
    for _ in range(2):
        sent(workers)
        table.worker_lost(prefill)
    assert isinstance(table.replies[-1], Error) and table.replies[-1].code == "worker_lost"
    assert not table.by_client


def test_moves_that_are_no_failure_do_not_count(table, workers, prompts):
    req = table.admit(b"client", "r1", prompts[3], GREEDY, True, None)
    table.open(req)
    for code in ("role_changed", "stream_moved", "kv_pool_full", "role_changed", "transfer_failed"):
        attempt = sent(workers)
        table.failed(RequestFailed(attempt.request_id, code, "moved", True, "prefill-0"))
    assert not table.replies and req.failures == 1 and req.attempt == 6
