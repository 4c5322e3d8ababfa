"""Decode workers on cores of their own: the plan every process of a node works out, and pinning every thread.

Pinning runs in a forked child, so the test process keeps its cores.
"""

import multiprocessing
import os
import threading

import msgspec
import pytest

from pdrt.cpu_placement import cores_for, pin, worker_cores
from pdrt.node_config import NodeConfig
from tests.system_client import allowed_cpus


def node(own_cores: bool = True, threads: tuple[int, int] | None = None, **settings) -> NodeConfig:
    """A node that asks for its decode workers to have cores of their own (unless told not to), the prefill and
    decode workers' `threads`, and `settings` on top."""
    experimental = {"own_cores": own_cores}
    if threads is not None:
        experimental |= {"prefill_threads": threads[0], "decode_threads": threads[1]}
    settings = {"model": "m", "mode": "disaggregated", "experimental": experimental, **settings}
    return NodeConfig.from_json(msgspec.json.encode(settings))


def test_on_two_cores_the_decode_worker_gets_the_second_and_everything_else_the_first():
    config = node(threads=(1, 1))
    assert worker_cores(config, [0, 1]) == {"prefill-0": [0], "decode-0": [1]}
    assert cores_for(config, "decode-0", [0, 1]) == [1]
    assert all(cores_for(config, name, [0, 1]) == [0] for name in ("prefill-0", "gateway", "controller"))


def test_decode_workers_get_their_threads_worth_of_the_cores_the_node_was_started_on_in_start_order():
    config = node(threads=(2, 2), node="b", prefill={"count": 2}, decode={"count": 2})
    allowed = [2, 3, 5, 7, 8, 9, 11, 12, 13, 14]
    assert cores_for(config, "decode-b-0", allowed) == [8, 9] and cores_for(config, "decode-b-1", allowed) == [11, 12]
    assert cores_for(config, "prefill-b-1", allowed) == cores_for(config, "gateway", allowed) == [2, 3, 5, 7, 13, 14]


def test_a_decode_worker_that_borrows_prefill_threads_may_also_run_on_the_prefill_workers_cores():
    config = node(threads=(1, 1), prefill={"count": 2})
    assert cores_for(config, "decode-0", [0, 1, 2, 3], borrows=True) == [2, 0, 1]


@pytest.mark.parametrize("config, allowed", [
    (NodeConfig(model="m", mode="disaggregated"), [0, 1, 2, 3]),  # by default
    (node(threads=(1, 1)), [0]),  # the workers' threads outnumber the cores
    (node(threads=(1, 2), prefill={"count": 0}), [0, 1]),  # no core left for the rest
    (node(own_cores=False, threads=(1, 1)), [0, 1]),
    (node(mode="colocated"), [0, 1, 2, 3]),
    (node(threads=(1, 1), engine={"device": "cuda"}), [0, 1, 2, 3]),
    (node(decode={"count": 0}), [0, 1, 2, 3]),
])
def test_a_node_is_not_pinned_without_cores_to_spare_when_turned_off_colocated_or_on_a_gpu(config, allowed):
    assert cores_for(config, "decode-0", allowed) is None and cores_for(config, "gateway", allowed) is None


def pin_with_a_thread_running(core: int, results) -> None:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, args=(10,))  # started before: pinned with the rest
    helper.start()
    try:
        pin([core], "test")
        later = threading.Thread(target=lambda: results.put(("later", os.sched_getaffinity(0))))
        later.start()  # started after: inherits it
        later.join()
        results.put(("all", allowed_cpus(os.getpid())))
    finally:
        stop.set()
        helper.join()


def test_pinning_moves_every_thread_and_threads_started_later_inherit_it():
    core = max(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=pin_with_a_thread_running, args=(core, results))
    child.start()
    seen = dict(results.get(timeout=30) for _ in range(2))
    child.join(timeout=30)
    assert child.exitcode == 0
    assert seen == {"later": {core}, "all": {frozenset({core})}}
