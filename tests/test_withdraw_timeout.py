"""A withdraw that no prefill worker answers (the answer lost, or the worker wedged) does not strand its request:
after WITHDRAW_TIMEOUT_S the gateway's request table starts it again, and a late answer to the old attempt
changes nothing."""

import time
from collections import Counter

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import total
from pdrt.roles import request_table
from pdrt.wire import Abort, PrefillRequest, Withdraw, Withdrawn
from tests.conftest import received

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
TIMEOUT_S = 0.2


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
    assert req.failures == 0, "a restart of an unstarted prompt is no failure"

    # The prefill worker's answer to the first attempt arrives at last: it names an attempt that is gone.
    table.withdrawn(Withdrawn(first.request_id, True, "prefill-0"))
    assert req.internal_id == again.request_id and req.prefill is not None and req.prefill.process_id == "prefill-0"
    assert total(list(table.metrics.registry.collect()), "pdrt_gateway_prefills_moved_total") == 0
    assert table.router.open_requests == Counter({"prefill-0": 1, "decode-0": 1})
    assert table.replies == [], "the client heard nothing of it"
